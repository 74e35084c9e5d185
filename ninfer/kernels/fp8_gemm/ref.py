"""Block-scaled FP8 GEMM for prefill (reference): activations quantized per token and 128
columns, times a block-scaled e4m3 weight, on FP8 operands throughout.

Activations: quantize_groups gives each row and 128-column group of x its own scale,
amax * fp32(1/448) as fp8_quant's per-row scales (the group's largest magnitude maps onto
448), and x / scale rounded to nearest, clamped to +-448, converted to e4m3 round-to-
nearest-even. All-zero groups take the scale of amax 1e-12.

Weights: e4m3 [N, K] with one of gemv/ref.py's two block layouts (scale_rows_per_block):
  - row blocks [N, ceil(K/128)]: w[n, k] = fp8[n, k] * scale[n, k // 128] (the loader's,
    so packed projections' parts need not start on 128-row boundaries)
  - 128 x 128 blocks [ceil(N/128), ceil(K/128)]: w[n, k] = fp8[n, k] * scale[n // 128, k // 128]

Product: both operands have one scale per 128 columns of K, so each K group is an exact
e4m3 product summed in fp32, scaled once by its row's and column's scales:
    out[m, n] = sum_g (sum_{k in g} x_fp8[m, k] * w_fp8[n, k]) * x_scale[m, g] * w_scale[n, g]
then + bias, rounded once to out_dtype. The last group may be partial (K % 128 != 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.kernels.fp8_quant.ref import FP8, FP8_MAX, row_scales
from ninfer.kernels.gemv.ref import SCALE_BLOCK, scale_rows_per_block


def num_groups(cols: int) -> int:
    """Scale groups of 128 columns over `cols` columns (the last one may be partial)."""
    return -(-cols // SCALE_BLOCK)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16, fp16 or fp32) -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)])."""
    if x.dim() != 2:
        raise ValueError(f"quantize_groups takes [M, K], got {tuple(x.shape)}")
    rows, cols = x.shape
    groups = num_groups(cols)
    # Zero padding to whole groups: it changes no group's amax.
    padded = F.pad(x.float(), (0, groups * SCALE_BLOCK - cols)).view(rows, groups, SCALE_BLOCK)
    scale = row_scales(padded.abs().amax(dim=-1))
    quantized = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(rows, -1)[:, :cols].to(FP8)
    return quantized, scale


def weight_row_scales(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """Either block layout -> fp32 [N, ceil(K/128)], one scale row per weight row."""
    rows_per_block = scale_rows_per_block(weight, weight_scale)
    if rows_per_block is None:
        raise ValueError(
            f"weight_scale {tuple(weight_scale.shape)} fits no block layout of weight {tuple(weight.shape)}:"
            f" want [N, ceil(K/128)] or [ceil(N/128), ceil(K/128)]"
        )
    return weight_scale.float().repeat_interleave(rows_per_block, dim=0)[: weight.shape[0]]


def block_fp8_matmul(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x_fp8 e4m3 [M, K] with x_scale fp32 [M, ceil(K/128)], weight e4m3 [N, K] with
    weight_scale in either block layout, bias [N] -> [M, N] in out_dtype."""
    rows, cols = x_fp8.shape
    if x_fp8.dtype != FP8 or weight.dtype != FP8:
        raise ValueError(f"x_fp8 and weight must be {FP8}, got {x_fp8.dtype} and {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != cols:
        raise ValueError(f"weight must be [N, {cols}], got {tuple(weight.shape)}")
    if tuple(x_scale.shape) != (rows, num_groups(cols)):
        raise ValueError(f"x_scale must be [{rows}, {num_groups(cols)}], got {tuple(x_scale.shape)}")
    w_scale = weight_row_scales(weight, weight_scale)
    x_scale = x_scale.float()
    out = torch.zeros(rows, weight.shape[0], dtype=torch.float32, device=x_fp8.device)
    for group in range(num_groups(cols)):
        cols_of_group = slice(group * SCALE_BLOCK, (group + 1) * SCALE_BLOCK)
        # e4m3 products are exact in fp32 (4 significant bits each); the sum rounds.
        partial = x_fp8[:, cols_of_group].float() @ weight[:, cols_of_group].float().T
        out += partial * x_scale[:, group, None] * w_scale[None, :, group]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype, through per-group FP8 activations:
    quantize_groups, then block_fp8_matmul (Fp8Linear's prefill path for block-scaled weights)."""
    x_fp8, x_scale = quantize_groups(x)
    return block_fp8_matmul(x_fp8, x_scale, weight, weight_scale, x.dtype, bias)
