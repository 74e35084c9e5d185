"""Distribution: percentiles of a sample, with the sample size they rest on."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default); `ordered` is sorted and non-empty."""
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    samples: int
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        ordered = sorted(values)
        if not ordered:
            return cls(0, None, None, None)
        return cls(len(ordered), percentile(ordered, 50), percentile(ordered, 90), percentile(ordered, 99))
