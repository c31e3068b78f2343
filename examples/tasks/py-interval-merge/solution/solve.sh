#!/bin/bash
# Oracle: rewrite merge_intervals without the four bugs (in-place sort, touching
# intervals kept apart, a contained interval shrinking the end, lists not normalised).
set -euo pipefail
cat > /app/calendar_tools/intervals.py <<'PY'
"""Merging of closed integer intervals."""


def merge_intervals(intervals):
    """Merge overlapping or touching (start, end) intervals.

    Returns a new list of (start, end) tuples, sorted by start, in which no two
    intervals overlap or touch. The input list is left unchanged.
    """
    merged = []
    for start, end in sorted(tuple(pair) for pair in intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
PY
