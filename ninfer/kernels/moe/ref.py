"""Routed mixture-of-experts reference: softmax router, top-k, SwiGLU experts."""

import torch
import torch.nn.functional as F


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
) -> torch.Tensor:
    """x: [T, H]; gate_up_proj: [E, 2I, H] (gate rows then up rows); down_proj: [E, H, I]."""
    out = torch.zeros_like(x)
    num_experts = gate_up_proj.shape[0]
    hit = torch.bincount(expert_ids.flatten(), minlength=num_experts).nonzero().flatten().tolist()
    for e in hit:
        token_idx, slot = torch.where(expert_ids == e)
        h = F.linear(x[token_idx], gate_up_proj[e])
        gate, up = h.chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, down_proj[e])
        out.index_add_(0, token_idx, (h * weights[token_idx, slot, None]).to(out.dtype))
    return out
