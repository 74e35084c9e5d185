"""capture_graph: one region of static-buffer work captured into a CUDA graph.

The region first runs once on a side stream (Triton compiles and autotunes, libraries create
their handles: none of that may happen during capture), then once under capture into the
shared memory pool. One warm-up run is enough: each of those happens at a kernel's first call
for its shape, and capture repeats the warm-up's shapes. Every set of graphs (decode, verify,
commit, step) captures this way.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def capture_graph(
    region: Callable[[], torch.Tensor | None], pool, device: torch.device, phases: dict[str, float] | None = None
):
    """-> (the graph, the region's output as captured: a static tensor each replay rewrites).
    phases: filled with the host seconds of the warm-up's launches and of the capture (which
    begins by waiting for the device and emptying torch's device and pinned-host caches)."""
    started = time.perf_counter()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        region()
    torch.cuda.current_stream(device).wait_stream(side)
    warmed = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = region()
    if phases is not None:
        phases["warm_up"] = warmed - started
        phases["capture"] = time.perf_counter() - warmed
    return graph, output
