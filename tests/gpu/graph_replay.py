"""Shared check for the GPU tests: a CUDA graph of some kernel calls replays like eager."""

from __future__ import annotations

from collections.abc import Callable

import torch


def assert_replay_equals_eager(
    step: Callable[[dict[str, torch.Tensor]], list[torch.Tensor]],
    fresh: Callable[[int], dict[str, torch.Tensor]],
    seeds: tuple[int, ...] = (100, 200, 300),
) -> None:
    """Capture step(fresh(0)), then per seed copy fresh(seed) into the captured inputs, replay,
    and require every output to equal step run eagerly on the same inputs, bit for bit."""
    static = fresh(0)
    step(static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static)
    for seed in seeds:
        new = fresh(seed)
        for name, tensor in new.items():
            static[name].copy_(tensor)
        graph.replay()
        eager = step(new)
        for replayed, expected in zip(static_out, eager, strict=True):
            assert torch.equal(replayed, expected)
