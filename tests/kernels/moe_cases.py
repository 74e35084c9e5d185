"""What the routed-experts tests share: tokens with their routing, and the error measure."""

from __future__ import annotations

import torch

from ninfer.kernels.moe import ref


def routed(num_tokens: int, hidden: int, num_experts: int, top_k: int, seed: int, device: str = "cpu"):
    """-> (x [T, H] fp32, route weights [T, k], expert ids [T, k]) from seeded random logits."""
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device)
    weights, ids = ref.route(torch.randn(num_tokens, num_experts, generator=gen, device=device), top_k, True)
    return x, weights, ids


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """||out - expected|| / ||expected|| in float64; out must be finite."""
    out, expected = out.double(), expected.double()
    assert torch.isfinite(out).all()
    return ((out - expected).norm() / expected.norm()).item()
