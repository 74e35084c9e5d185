"""The length of the longest common prefix of two sequences (token lists or texts)."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Binary search over slice compares, which run at C speed: far faster than a Python loop
    over 100K-token prompts."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
