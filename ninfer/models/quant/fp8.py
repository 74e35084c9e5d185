"""FP8 e4m3 weights: per-output-channel scales (on-the-fly quantization of bf16 Linear layers)
or 128x128 block scales (Qwen's FP8 checkpoints).

Decode streams every weight once per step, so halving weight bytes nearly doubles the
bandwidth roofline. Up to gemv.MAX_ROWS tokens the product is a weight-only GEMV (FP8
bytes widened in registers, bf16 activations); larger batches (prefill) quantize
activations per token and run on Hopper's FP8 matrix units: through torch._scaled_mm
(row-wise scales) for per-channel weights, through kernels/fp8_gemm (per 128-column group,
block scales applied in the K loop) for block-scaled ones. The 3-D fused MoE experts
become Fp8Experts (fp8_experts.py). The embedding and lm_head stay in bf16 (the embedding
reads one row per token; lm_head precision drives sampling), and so do MoE routers.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.kernels.activation import silu_and_mul
from ninfer.kernels.fp8_gemm import fp8_linear
from ninfer.kernels.fp8_quant import quantize_rows
from ninfer.kernels.fp8_quant.ref import FP8_MAX
from ninfer.kernels.gemv import MAX_ROWS, conv_first_columns, gemv, gemv_causal_conv1d_update, gemv_silu_and_mul
from ninfer.kernels.gemv.ref import FP8, SCALE_BLOCK, dequantize, fp8_scales, quantize_blocks
from ninfer.models.layers.moe import Experts
from ninfer.models.quant.fp8_experts import Fp8Experts
from ninfer.models.quant.linear_replacement import replace_linear_layers, replace_modules
from ninfer.models.quant.row_chunks import quantize_rows_into
from ninfer.models.quant.stored_write import StoredWrite

_ROW_MULTIPLE = 16  # _scaled_mm wants row counts in multiples of 16


class Fp8Linear(nn.Module):
    stored_weights = ("weight",)  # StoresCheckpointWrites

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        parts: dict[str, int] | None = None,
    ):
        """weight_scale: float32 [out] (per channel), [ceil(out/128), ceil(in/128)] (128x128
        blocks) or [out, ceil(in/128)] (row blocks: a checkpoint's block scales expanded per
        row, so packed parts need not start on a 128-row boundary). parts: a PackedLinear's."""
        super().__init__()
        self.register_buffer("weight", weight)  # [out, in] float8_e4m3fn
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.parts = parts

    @classmethod
    def placeholder(cls, linear: nn.Linear, per_channel: bool = False) -> Fp8Linear:
        """An unfilled module shaped like `linear` (on its device, e.g. meta), for the loader to
        fill: row-block scales (a block-scaled FP8 checkpoint's), or with per_channel one scale
        per output row (what from_linear makes, quantized as the bf16 weights arrive)."""
        device = linear.weight.device
        out_features, in_features = linear.weight.shape
        weight = torch.empty(out_features, in_features, dtype=FP8, device=device)
        scale_shape = (out_features,) if per_channel else (out_features, -(-in_features // SCALE_BLOCK))
        scale = torch.empty(scale_shape, dtype=torch.float32, device=device)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(weight, scale, bias, getattr(linear, "parts", None))

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """One scale per output row, quantized a chunk of rows at a time (row_chunks.py)."""
        placeholder = cls.placeholder(linear, per_channel=True)
        quantize_rows_into(linear.weight.detach(), (placeholder.weight, placeholder.weight_scale), quantize_per_channel)
        return placeholder

    @classmethod
    @torch.no_grad()
    def from_linear_blocks(cls, linear: nn.Linear) -> Fp8Linear:
        """As Qwen's FP8 checkpoints store it: each stored part in 128x128 blocks, whose scales
        then become row blocks (parts need not start on a 128-row boundary), as the loader does."""
        parts = getattr(linear, "parts", None) or {"weight": linear.out_features}
        codes, scales, start = [], [], 0
        for num_rows in parts.values():
            part_codes, block_scale = quantize_blocks(linear.weight[start : start + num_rows], SCALE_BLOCK)
            codes.append(part_codes)
            scales.append(expand_block_rows(block_scale, num_rows))
            start += num_rows
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(torch.cat(codes), torch.cat(scales), bias, getattr(linear, "parts", None))

    def quantize_into(self, index, value: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Quantize bf16 weight rows into this module's layout: value is the weight's rows at
        `index` (None: all), rounded to dtype first when given (as an unquantized load would
        hold it). Per channel (--quantize fp8), or row blocks (an unquantized part of a
        projection whose other parts a checkpoint stores in FP8)."""
        if self.weight_scale.dim() == 1:
            quantize = quantize_per_channel
        elif self.weight_scale.shape[0] == self.out_features:
            quantize = quantize_row_blocks
        else:
            raise ValueError("128x128 block scales span rows; quantize_into writes row-local scales")
        targets = (self.weight, self.weight_scale)
        quantize_rows_into(value, targets if index is None else [t[index] for t in targets], quantize, dtype)

    def load_stored(self, attribute: str, write: StoredWrite, dtype: torch.dtype | None = None) -> None:
        """A checkpoint's write into the weight: FP8 values with their block scales as stored
        (row blocks), or with one scale per row into per-channel scales; anything else
        dequantized and quantized into this module's layout."""
        row_scale = None if self.block_scaled else write.one_scale_per_row()
        if write.fp8_row_scales is not None and self.block_scaled:
            write.copy_into(self.weight)
            write.target(self.weight_scale).copy_(write.fp8_row_scales)
        elif row_scale is not None:
            write.copy_into(self.weight)
            write.target(self.weight_scale).copy_(row_scale)
        else:
            self.quantize_into(write.index, write.dense(write.target(self.weight).shape), dtype)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def block_scaled(self) -> bool:
        return self.weight_scale.dim() == 2

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale).to(dtype)

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a packed gate | up projection: at GEMV sizes the activation is the
        GEMV's epilogue (one launch), else the product then the activation."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.shape[0] <= MAX_ROWS:
            out = gemv_silu_and_mul(rows, self.weight, self.weight_scale, self.bias)
            return out.reshape(*shape[:-1], self.out_features // 2)
        return silu_and_mul(self.forward(x))

    def forward_causal_conv1d_update(
        self, x: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor
    ) -> torch.Tensor:
        """x [B, K], one decode token per request: the product with the conv's decode step on
        its first conv_weight.shape[0] columns (at GEMV sizes in the GEMV's epilogue)."""
        if x.shape[0] <= MAX_ROWS:
            return gemv_causal_conv1d_update(
                x, self.weight, self.weight_scale, self.bias, conv_weight, conv_state, state_slots
            )
        return conv_first_columns(self.forward(x), conv_weight, conv_state, state_slots)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.shape[0] <= MAX_ROWS:
            out = gemv(rows, self.weight, self.weight_scale, self.bias)
            return out.reshape(*shape[:-1], self.out_features)
        if not rows.is_cuda:
            return F.linear(x, self.dequantized(x.dtype), self.bias)  # the CPU has no FP8 matmul
        if self.block_scaled:
            out = fp8_linear(rows, self.weight, self.weight_scale, self.bias)
            return out.reshape(*shape[:-1], self.out_features)
        num_rows = rows.shape[0]
        x_fp8, x_scale = quantize_rows(rows, _ROW_MULTIPLE)
        out = torch._scaled_mm(
            x_fp8, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale.view(1, -1), out_dtype=x.dtype
        )[:num_rows]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


# The MoE router ("mlp.gate") stays bf16 as in Qwen's FP8 checkpoints: expert choice is
# sensitive to its logits, and its 256 outputs gain nothing from FP8 prefill.
DEFAULT_SKIP = ("lm_head", "embed_tokens", "mlp.gate")


def quantize_fp8_(model: nn.Module, skip: tuple[str, ...] = DEFAULT_SKIP, placeholders: bool = False) -> int:
    """Replace every nn.Linear by an Fp8Linear and every fused Experts by an Fp8Experts in place
    (per output row scales), except those whose name ends in one of `skip` (whole dotted
    components: "mlp.gate" is not "mlp.gate_proj") and Linear layers with fewer than 16
    outputs; returns how many modules it replaced.
    placeholders: unfilled modules of that layout instead, on a meta-device model, for the
    loader to quantize each bf16 weight into as it arrives (loader.build_model)."""
    if placeholders:
        to_linear = partial(Fp8Linear.placeholder, per_channel=True)
        to_experts = partial(Fp8Experts.placeholder, rows_per_block=None)
    else:
        to_linear, to_experts = Fp8Linear.from_linear, Fp8Experts.from_experts
    linears = replace_linear_layers(model, skip, to_linear, lambda linear: linear.out_features >= 16)
    return linears + replace_modules(model, Experts, skip, to_experts)


def quantize_fp8_blocks_(model: nn.Module, skip: tuple[str, ...] = DEFAULT_SKIP) -> int:
    """quantize_fp8_ in the layout of Qwen's FP8 checkpoints: 128x128 block scales for Linear
    layers (per stored part) and routed experts; returns how many modules it replaced."""
    linears = replace_linear_layers(model, skip, Fp8Linear.from_linear_blocks, lambda linear: linear.out_features >= 16)
    return linears + replace_modules(model, Experts, skip, Fp8Experts.from_experts_blocks)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], fp32 scales [N]): one scale per output row, its amax / 448."""
    weight = weight.float()
    scale = fp8_scales(weight.abs().amax(dim=1).clamp(min=1e-12))
    return (weight / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_row_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], fp32 scales [N, ceil(K/128)]): one scale per row and
    128 columns, for unquantized parts of a packed projection whose other parts are FP8."""
    return quantize_blocks(weight, 1)


def expand_block_rows(block_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's [.., ceil(rows/128), ceil(K/128)] block scales -> one scale row per weight row."""
    return block_scale.float().repeat_interleave(SCALE_BLOCK, dim=-2)[..., :rows, :]
