"""capture_graph: one region of static-buffer work captured into a CUDA graph.

The region first runs once on a side stream (Triton compiles and autotunes, libraries create
their handles: none of that may happen during capture), then once under capture into the
shared memory pool. One warm-up run is enough: each of those happens at a kernel's first call
for its shape, and capture repeats the warm-up's shapes. Every set of graphs (decode, verify,
commit, step) captures this way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture_graph(region: Callable[[], torch.Tensor | None], pool, device: torch.device):
    """-> (the graph, the region's output as captured: a static tensor each replay rewrites)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        region()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = region()
    return graph, output
