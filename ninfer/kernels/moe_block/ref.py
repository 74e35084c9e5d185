"""A whole routed MoE block at decode sizes: router choice, the chosen experts' SwiGLU, their
weighted sum, and the sigmoid-gated shared expert, from the router's logits.

The reference is the block as the layers compute it op by op (kernels/moe's route and
fused_experts, then the shared expert's products and gate), with their roundings.
"""

from __future__ import annotations

import torch

from ninfer.kernels.activation.ref import sigmoid_mul
from ninfer.kernels.activation.ref import silu_and_mul
from ninfer.kernels.gemv.ref import gemv
from ninfer.kernels.moe.ref import ExpertScales, fused_experts, route
from ninfer.kernels.nvfp4_gemv.ref import gemv_nvfp4

# The fused kernels give every (token, expert) pair its own weight stream, which pays while
# tokens rarely share an expert: the layers use them up to this many tokens (a K = 3 verify
# round of one request) and kernels/moe's grouped kernels for larger batches.
MAX_TOKENS = 4


def moe_block(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    gate_up_scale: ExpertScales | None = None,
    down_scale: ExpertScales | None = None,
    shared_gate_up_scale: ExpertScales | None = None,
    shared_down_scale: ExpertScales | None = None,
) -> torch.Tensor:
    """x [T, H], router_logits [T, E]; experts gate_up_proj [E, 2I, H] (gate rows then up rows)
    and down_proj [E, H, I]; the shared expert (all three or none): shared_gate_up [2S, H],
    shared_down [H, S] and its gate shared_gate [1, H]. -> [T, H] in x's dtype.

    Quantized (weight-only): the experts e4m3 with gate_up_scale and down_scale in a layout of
    kernels/moe/ref.py, or NVFP4 codes with (block_scale, row_scale) pairs; on its own the
    shared expert's projections e4m3 with their scales in a layout of kernels/gemv/ref.py, or
    NVFP4 with pairs as nvfp4_gemv/ref.py lays them out; the shared gate stays in x's dtype."""
    if (shared_gate_up is None) != (shared_down is None) or (shared_gate_up is None) != (shared_gate is None):
        raise ValueError("the shared expert takes shared_gate_up, shared_down and shared_gate together")
    weights, expert_ids = route(router_logits, top_k, renormalize)
    out = fused_experts(x, weights, expert_ids, gate_up_proj, down_proj, gate_up_scale, down_scale)
    if shared_gate_up is not None:
        act = silu_and_mul(_product(x, shared_gate_up, shared_gate_up_scale))
        out = out + sigmoid_mul(_product(act, shared_down, shared_down_scale), gemv(x, shared_gate))
    return out


def _product(x: torch.Tensor, weight: torch.Tensor, scale: ExpertScales | None) -> torch.Tensor:
    """x @ weight^T as the shared expert's own Linear computes it (16-bit, FP8 or NVFP4)."""
    if isinstance(scale, tuple):
        return gemv_nvfp4(x, weight, *scale)
    return gemv(x, weight, scale)
