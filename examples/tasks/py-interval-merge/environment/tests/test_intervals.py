import unittest

from calendar_tools.intervals import merge_intervals


class MergeIntervalsTest(unittest.TestCase):
    def test_empty(self):
        self.assertEqual(merge_intervals([]), [])

    def test_single(self):
        self.assertEqual(merge_intervals([(4, 9)]), [(4, 9)])

    def test_disjoint_stay_apart(self):
        self.assertEqual(merge_intervals([(1, 2), (5, 6)]), [(1, 2), (5, 6)])

    def test_overlapping(self):
        self.assertEqual(merge_intervals([(1, 4), (2, 6)]), [(1, 6)])

    def test_touching_are_merged(self):
        self.assertEqual(merge_intervals([(1, 3), (3, 5)]), [(1, 5)])

    def test_contained_interval_keeps_outer_end(self):
        self.assertEqual(merge_intervals([(1, 10), (2, 3)]), [(1, 10)])

    def test_unsorted_input(self):
        self.assertEqual(
            merge_intervals([(8, 10), (1, 3), (2, 4), (15, 18)]),
            [(1, 4), (8, 10), (15, 18)],
        )

    def test_chain(self):
        self.assertEqual(merge_intervals([(5, 7), (1, 2), (2, 5), (7, 7)]), [(1, 7)])

    def test_input_not_modified(self):
        data = [(6, 8), (1, 2)]
        merge_intervals(data)
        self.assertEqual(data, [(6, 8), (1, 2)])

    def test_lists_accepted(self):
        self.assertEqual(merge_intervals([[3, 4], [1, 3]]), [(1, 4)])


if __name__ == "__main__":
    unittest.main()
