"""The peak of CPU memory torch allocates while a function runs, from the profiler's allocation records.

Every allocation and free of torch's CPU allocator is recorded with its size and time, so the
running sum in time order is the memory live beyond what existed before, and its maximum the
peak: temporaries inside an op included, which no tensor-level hook sees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")


def allocation_peak(run: Callable[[], T]) -> tuple[T, int]:
    """(run()'s result, the most bytes torch held on the CPU at once during it beyond what it held before)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        result = run()
    records = sorted(
        (event.start_ns(), event.nbytes())
        for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]"
    )
    live = peak = 0
    for _, change in records:
        live += change
        peak = max(peak, live)
    return result, peak
