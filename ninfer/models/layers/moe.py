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

    def scale_of(self, projection: str) -> None:
        """The kernels' scale argument for `projection` (quantized experts have one)."""
        return None

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

    def _block_weights(self, x: torch.Tensor) -> tuple | None:
        """moe_block's weight arguments where it computes this block, else None. It takes decode
        sizes, and weights in x's dtype, e4m3 with scales or NVFP4 codes with theirs (experts and
        the shared expert's projections each in their own format, no biases; the shared gate in
        x's dtype); prefill and other formats run the modules' own kernels."""
        if x.shape[0] > MAX_TOKENS:
            return None
        experts = [_expert_operand(self.experts, name, x.dtype) for name in ("gate_up_proj", "down_proj")]
        if self.shared_expert is None:
            shared = [(None, None)] * 3
        else:
            linears = (self.shared_expert.gate_up_proj, self.shared_expert.down_proj, self.shared_expert_gate)
            shared = [_linear_operand(linear, x.dtype) for linear in linears]
            if shared[2] is not None and shared[2][1] is not None:
                return None  # the kernel takes the shared gate (one row) unquantized
        if any(operand is None for operand in experts + shared):
            return None
        (gate_up, gate_up_scale), (down, down_scale) = experts
        (shared_gate_up, shared_gate_up_scale), (shared_down, shared_down_scale), (shared_gate, _) = shared
        return (gate_up, down, shared_gate_up, shared_down, shared_gate,
                gate_up_scale, down_scale, shared_gate_up_scale, shared_down_scale)  # fmt: skip


def _expert_operand(experts: nn.Module, projection: str, dtype: torch.dtype) -> tuple | None:
    """(weight, scale) of a fused expert projection as the kernels take it, or None for a format
    moe_block does not run."""
    weight = getattr(experts, projection, None)
    scale_of = getattr(experts, "scale_of", None)
    if not isinstance(weight, torch.Tensor) or scale_of is None:
        return None
    return _operand(weight, scale_of(projection), dtype)


def _linear_operand(linear: nn.Module, dtype: torch.dtype) -> tuple | None:
    """(weight, scale) of a Linear, Fp8Linear or Nvfp4Linear without bias, or None."""
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or getattr(linear, "bias", None) is not None:
        return None
    if weight.dtype == torch.uint8:
        return _operand(weight, (linear.block_scale, linear.row_scale), dtype)
    return _operand(weight, getattr(linear, "weight_scale", None), dtype)


def _operand(weight: torch.Tensor, scale, dtype: torch.dtype) -> tuple | None:
    """(weight, scale) if the pair is one of moe_block's formats: x's dtype unscaled, e4m3 with a
    scale tensor, NVFP4 codes with (block_scale, row_scale)."""
    formats = {dtype: type(None), FP8: torch.Tensor, torch.uint8: tuple}
    return (weight, scale) if isinstance(scale, formats.get(weight.dtype, ())) else None
