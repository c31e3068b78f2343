"""Merging of closed integer intervals."""


def merge_intervals(intervals):
    """Merge overlapping or touching (start, end) intervals.

    Returns a new list of (start, end) tuples, sorted by start, in which no two
    intervals overlap or touch. The input list is left unchanged.
    """
    if not intervals:
        return []
    intervals.sort()
    merged = [intervals[0]]
    for start, end in intervals[1:]:
        last_start, last_end = merged[-1]
        if start < last_end:
            merged[-1] = (last_start, end)
        else:
            merged.append((start, end))
    return merged
