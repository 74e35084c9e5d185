"""RoundCosts: what a speculative round costs in plain decode rounds, by drafts and context.

The shape of the cost comes from a measured table: the 27B at batch 1 on an H200 (bf16, MTP
head through the reduced proposal head, verify graphs; docs/perf/2026-12-04T20-bench-27b-verify.md),
where the verification rows' attention is what grows with the context. Its level depends on the
GPU, the weight format and the kernels, so a CUDA engine times its own batch-1 round against a
plain one at start-up (runner_graphs.time_round_ratio) and the table is shifted to pass through
that measurement at its number of drafts (`calibrated`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# Verify round time / plain decode round time by drafts per round, at two contexts.
MEASURED_ROUND_COST: Mapping[int, Mapping[int, float]] = MappingProxyType({
    4096: MappingProxyType({1: 1.134, 2: 1.297, 3: 1.367, 5: 1.478, 7: 1.549}),
    131072: MappingProxyType({1: 1.187, 2: 1.496, 3: 1.555, 5: 1.641, 7: 1.723}),
})


def _interpolate(points: Mapping[int, float], x: float) -> float:
    """Piecewise linear through the points, extended past the last two (and below the first: flat)."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    for low, high in zip(xs, xs[1:]):
        if x <= high:
            return points[low] + (points[high] - points[low]) * (x - low) / (high - low)
    low, high = xs[-2], xs[-1]
    return points[high] + (points[high] - points[low]) * (x - high) / (high - low)


@dataclass(frozen=True)
class RoundCosts:
    table: Mapping[int, Mapping[int, float]] = field(default_factory=lambda: MEASURED_ROUND_COST)
    shift: float = 0.0  # added to every ratio of the table (a calibration)

    def ratio(self, num_drafts: int, context: int) -> float:
        """A verify round of num_drafts drafts at `context` tokens, in plain decode rounds (> 1)."""
        by_context = {length: _interpolate(costs, num_drafts) for length, costs in self.table.items()}
        return max(1.0, _interpolate(by_context, context) + self.shift)

    @classmethod
    def calibrated(cls, num_drafts: int, measured_ratio: float) -> RoundCosts:
        """The table shifted to give measured_ratio at num_drafts and its shortest context (the
        start-up timing runs at a near-empty context)."""
        shortest = min(MEASURED_ROUND_COST)
        return cls(shift=measured_ratio - cls().ratio(num_drafts, shortest))
