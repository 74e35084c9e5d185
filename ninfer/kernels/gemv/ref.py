"""Skinny matmul out = x @ W^T (+ bias) for decode batches, with bf16 or FP8 e4m3 weights.

Weight-only FP8: the activations stay in x's dtype and the FP8 weight is dequantized to
fp32, so the only error against a full-precision product is the weight's own quantization.
Three scale layouts (weight_scale.dim(), then its shape: scale_rows_per_block):
  - per output channel: weight_scale [N], w[n, k] = fp8[n, k] * scale[n]  (Fp8Linear)
  - 128 x 128 blocks: weight_scale [ceil(N/128), ceil(K/128)],
    w[n, k] = fp8[n, k] * scale[n // 128, k // 128]  (Qwen FP8 checkpoints' weight_scale_inv)
  - row blocks: weight_scale [N, ceil(K/128)], w[n, k] = fp8[n, k] * scale[n, k // 128]
    (a 1 x 128 block per row: packed projections whose parts' 128-row blocks no longer
    line up, each row carrying its part's block scales)
Computed in fp32, rounded once to x's dtype.
"""

from __future__ import annotations

import torch

from ninfer.kernels.activation.ref import silu_and_mul
from ninfer.kernels.causal_conv1d.ref import causal_conv1d_update
from ninfer.kernels.fp8_quant.ref import FP8_MAX

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 128  # rows and columns per block scale in Qwen's FP8 checkpoints
# The largest M the fast path takes (a verify round of 8 requests x 4 tokens); larger batches
# go to ref (a plain matmul).
MAX_ROWS = 32


def scale_rows_per_block(weight: torch.Tensor, weight_scale: torch.Tensor | None) -> int | None:
    """Weight rows per row of a 2-D weight_scale for weight [N, K]: 1 (row blocks) iff
    weight_scale.shape == (N, ceil(K/128)) and N > 1; else 128 (128 x 128 blocks) iff
    weight_scale.shape == (ceil(N/128), ceil(K/128)); else None (no scale, per channel, or
    a shape that is neither). N > 1 makes the two shapes distinct (N != ceil(N/128)); at
    N == 1 they are one and the same [1, ceil(K/128)] tensor, taken as 128 x 128."""
    if weight_scale is None or weight_scale.dim() != 2:
        return None
    n, k = weight.shape
    k_blocks = -(-k // SCALE_BLOCK)
    shape = tuple(weight_scale.shape)
    if n > 1 and shape == (n, k_blocks):
        return 1
    if shape == (-(-n // SCALE_BLOCK), k_blocks):
        return SCALE_BLOCK
    return None


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor | None) -> torch.Tensor:
    """weight [N, K] (+ its scales) -> fp32 [N, K]."""
    w = weight.float()
    if weight_scale is None:
        return w
    if weight_scale.dim() == 1:
        return w * weight_scale.float()[:, None]
    rows = scale_rows_per_block(weight, weight_scale)
    if rows is None:
        raise ValueError(f"2-D weight_scale {tuple(weight_scale.shape)} fits no block layout of weight {tuple(weight.shape)}")
    n, k = w.shape
    per_row = weight_scale.float().repeat_interleave(rows, dim=0)[:n]
    return w * per_row.repeat_interleave(SCALE_BLOCK, dim=1)[:, :k]


def fp8_scales(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 as the CPU computes it on every device: CUDA divides by a Python scalar through
    its reciprocal (another rounding), by a tensor exactly."""
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_blocks(weight: torch.Tensor, rows_per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (e4m3 [..., N, K], fp32 scales [..., ceil(N/rows_per_block),
    ceil(K/128)]): one scale per block of rows_per_block rows x 128 columns (edge blocks padded
    with zeros for their amax)."""
    *lead, rows, cols = weight.shape
    row_blocks, col_blocks = -(-rows // rows_per_block), -(-cols // SCALE_BLOCK)
    padded = torch.nn.functional.pad(weight.float(), (0, col_blocks * SCALE_BLOCK - cols, 0, row_blocks * rows_per_block - rows))
    blocks = padded.view(*lead, row_blocks, rows_per_block, col_blocks, SCALE_BLOCK)
    scale = fp8_scales(blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12))
    quantized = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return quantized.view(padded.shape)[..., :rows, :cols].to(FP8), scale


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K], weight [N, K] (x's dtype, or float8_e4m3fn with weight_scale), bias [N] -> [M, N] in x's dtype."""
    out = x.float() @ dequantize(weight, weight_scale).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def gemv_silu_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(gate) * up of a gate | up projection: weight [2I, K] (gate rows first) -> [M, I]."""
    return silu_and_mul(gemv(x, weight, weight_scale, bias))


def gemv_causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """gemv, then one decode step of the depthwise causal conv + silu (conv_weight [C, K],
    conv_state [slots, C, K-1] updated in place, row m in slot state_slots[m]) on its first C
    columns; the other columns as the GEMV gives them."""
    out = gemv(x, weight, weight_scale, bias)
    channels = conv_weight.shape[0]
    mixed = causal_conv1d_update(out[:, :channels], conv_weight, conv_state, state_slots)
    return torch.cat((mixed, out[:, channels:]), dim=1)
