"""Routed mixture of experts with an optional sigmoid-gated shared expert."""

from __future__ import annotations

import torch
from torch import nn

from ninfer.kernels.activation import sigmoid_mul
from ninfer.kernels.gemv.ref import FP8
from ninfer.kernels.moe import fused_experts, route
from ninfer.kernels.moe_block import MAX_TOKENS, moe_block
from ninfer.models.config import ModelConfig
from ninfer.models.layers.linear import Linear
from ninfer.models.layers.mlp import MLP


class Experts(nn.Module):
    """All experts' weights fused in 3-D tensors (the Qwen3.5 checkpoint layout)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, weights, expert_ids, self.gate_up_proj, self.down_proj)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)
        block = self._block_weights(x)
        if block is not None:
            return moe_block(x, router_logits, self.top_k, self.renormalize, *block)
        weights, expert_ids = route(router_logits, self.top_k, self.renormalize)
        out = self.experts(x, weights, expert_ids)
        if self.shared_expert is not None:
            out = out + sigmoid_mul(self.shared_expert(x), self.shared_expert_gate(x))
        return out

    def _block_weights(self, x: torch.Tensor) -> tuple[torch.Tensor | None, ...] | None:
        """moe_block's weight arguments where it computes this block, else None. It takes decode
        sizes, and weights in x's dtype or e4m3 with scales (Experts or Fp8Experts, Linear or
        Fp8Linear, no biases); prefill and other formats run the modules' own kernels."""
        if x.shape[0] > MAX_TOKENS:
            return None
        experts = self.experts
        weights = [getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)]
        scales = [getattr(experts, "gate_up_proj_scale", None), getattr(experts, "down_proj_scale", None)]
        linears = ()
        if self.shared_expert is not None:
            linears = (self.shared_expert.gate_up_proj, self.shared_expert.down_proj, self.shared_expert_gate)
            weights += [getattr(linear, "weight", None) for linear in linears]
            scales += [getattr(linear, "weight_scale", None) for linear in linears]
            if scales.pop() is not None:  # the kernel takes the shared gate unquantized (it has one row)
                return None
        if any(getattr(linear, "bias", None) is not None for linear in linears):
            return None
        for weight, scale in zip(weights, scales + [None]):
            if not isinstance(weight, torch.Tensor) or weight.dtype != (x.dtype if scale is None else FP8):
                return None
        if self.shared_expert is None:
            return (*weights, None, None, None, *scales)
        return (*weights, *scales)
