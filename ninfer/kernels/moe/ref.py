"""Routed mixture-of-experts reference: softmax router, top-k, SwiGLU experts.

Experts come in x's dtype or as FP8 (weight-only): e4m3 weights with fp32 scales in one of
gemv.ref's layouts, per expert: per output row (scales [E, N]), 128 x 128 blocks
([E, ceil(N/128), ceil(K/128)], Qwen's checkpoints) or row blocks ([E, N, ceil(K/128)]: a
checkpoint's per-expert gate and up whose 128-row blocks do not line up once fused).
NVFP4 experts (ModelOpt's layout, kernels/nvfp4_gemv/ref.py, per expert): uint8 codes two a byte,
[E, N, K/2], with the scale a pair (block_scale e4m3 [E, N, K/16], row_scale fp32 [E, N]).
"""

import torch
import torch.nn.functional as F

from ninfer.kernels.gemv.ref import dequantize
from ninfer.kernels.nvfp4_gemv.ref import dequantize_nvfp4, quantize_nvfp4

# An expert weight's scales: an FP8 layout's tensor, or NVFP4's (block_scale, row_scale).
ExpertScales = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights [T, k] in the logits' dtype, expert ids [T, k]); softmax in fp32."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


def fused_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_scale: ExpertScales | None = None,
    down_scale: ExpertScales | None = None,
) -> torch.Tensor:
    """x: [T, H]; gate_up_proj: [E, 2I, H] (gate rows then up rows); down_proj: [E, H, I].

    FP8 experts: e4m3 weights with gate_up_scale and down_scale; NVFP4 experts: uint8 codes
    with (block_scale, row_scale) pairs (layouts above). Each chosen expert's weights are
    dequantized in fp32, its products computed in fp32 (or x's dtype if wider) and rounded to
    x's dtype where the unquantized path's products are.
    """
    out = torch.zeros_like(x)
    num_experts = gate_up_proj.shape[0]
    hit = torch.bincount(expert_ids.flatten(), minlength=num_experts).nonzero().flatten().tolist()
    for e in hit:
        token_idx, slot = torch.where(expert_ids == e)
        h = _expert_product(x[token_idx], gate_up_proj[e], _of_expert(gate_up_scale, e))
        gate, up = h.chunk(2, dim=-1)
        h = _expert_product(F.silu(gate) * up, down_proj[e], _of_expert(down_scale, e))
        out.index_add_(0, token_idx, (h * weights[token_idx, slot, None]).to(out.dtype))
    return out


def _of_expert(scale: ExpertScales | None, expert: int) -> ExpertScales | None:
    if isinstance(scale, tuple):
        return scale[0][expert], scale[1][expert]
    return None if scale is None else scale[expert]


def _dequantized(weight: torch.Tensor, scale: ExpertScales) -> torch.Tensor:
    """One expert's quantized weight [N, K] (codes [N, K/2] for NVFP4) -> fp32 [N, K]."""
    if isinstance(scale, tuple):
        return dequantize_nvfp4(weight, *scale)
    return dequantize(weight, scale)


def _expert_product(x: torch.Tensor, weight: torch.Tensor, scale: ExpertScales | None) -> torch.Tensor:
    if scale is None:
        return F.linear(x, weight)
    compute = torch.promote_types(x.dtype, torch.float32)
    return F.linear(x.to(compute), _dequantized(weight, scale).to(compute)).to(x.dtype)


def dequantize_experts(weight: torch.Tensor, scale: ExpertScales, dtype: torch.dtype) -> torch.Tensor:
    """FP8 or NVFP4 experts with scales in a layout above -> [E, N, K] in dtype: each weight
    times its scales in fp32, rounded once (what a 16-bit grouped GEMM takes at prefill sizes)."""
    return torch.stack([_dequantized(weight[e], _of_expert(scale, e)) for e in range(weight.shape[0])]).to(dtype)


def quantize_nvfp4_experts(weight: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Experts [E, N, K] (or one matrix [N, K]) -> NVFP4 codes and their (block_scale, row_scale),
    each row its own scale (nvfp4_gemv's recipe), one expert at a time (the quantization's
    temporaries hold ~180 bytes a weight)."""
    if weight.dim() == 2:
        codes, block_scale, row_scale = quantize_nvfp4(weight)
        return codes, (block_scale, row_scale)
    parts = [quantize_nvfp4(expert) for expert in weight]
    codes, block_scale, row_scale = (torch.stack(part) for part in zip(*parts))
    return codes, (block_scale, row_scale)
