"""float16 storage for the Linear weights of a float32 model on the CPU.

A CPU decodes as fast as it streams weights: the default model's fp32 weights are 540 MB
per token. Stored in float16 they are half that, and torch's float16 GEMV (fp32
accumulation) streams them faster per byte too: decode goes from ~18 to ~36 tok/s on one
core (kernels/gemv/cpu.py). Activations, norms, attention, the KV cache and the input
embedding stay float32; prefill widens each weight back to fp32 for its GEMM, so the
only change there is the weight's rounding to float16 (2^-11 relative: a hundredth of a
4-bit GGUF block's step). lm_head gets its own float16 copy of a tied embedding. MoE
routers stay float32 (expert choice is sensitive to their logits; they are small).
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer.kernels.gemv import linear_half_weight
from ninfer.models.quant.linear_replacement import UnfusedEpilogues, replace_linear_layers

FP16_MAX = torch.finfo(torch.float16).max
DEFAULT_SKIP = ("embed_tokens", "mlp.gate")


class HalfWeightLinear(UnfusedEpilogues, nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, parts: dict[str, int] | None = None):
        """weight [out, in] float16; bias (float32) stays as given; parts: a PackedLinear's."""
        super().__init__()
        self.register_buffer("weight", weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.parts = parts

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> HalfWeightLinear:
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(linear.weight.detach().to(torch.float16), bias, getattr(linear, "parts", None))

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_half_weight(x, self.weight, self.bias)


def store_half_weights_(model: nn.Module, skip: tuple[str, ...] = DEFAULT_SKIP) -> int:
    """Replace every float32 nn.Linear by a HalfWeightLinear in place, except those whose name
    ends in one of `skip` (whole dotted components) or whose weights leave float16's range;
    returns how many."""
    return replace_linear_layers(
        model,
        skip,
        HalfWeightLinear.from_linear,
        lambda linear: linear.weight.dtype == torch.float32 and linear.weight.abs().amax() <= FP16_MAX,
    )
