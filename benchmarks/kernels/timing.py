"""Shared timing for the kernel benchmarks: CUDA-event medians of graph-replayed (or eager)
calls after warm-up, and the device-to-device copy bandwidth they are compared with."""

from __future__ import annotations

import statistics

import torch


def median_seconds(fn, replays: int = 30, graph: bool = True) -> float:
    """Median time of one fn() call (fn launches device work only), after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
        for _ in range(3):
            run()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    src = torch.randn(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * num_bytes / median_seconds(lambda: dst.copy_(src), replays=20, graph=False)
