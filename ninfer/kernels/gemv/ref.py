"""Skinny matmul out = x @ W^T (+ bias) for decode batches, with bf16 or FP8 e4m3 weights.

Weight-only FP8: the activations stay in x's dtype and the FP8 weight is dequantized to
fp32, so the only error against a full-precision product is the weight's own quantization.
Two scale layouts (chosen by weight_scale.dim()):
  - per output channel: weight_scale [N], w[n, k] = fp8[n, k] * scale[n]  (Fp8Linear)
  - 128 x 128 blocks: weight_scale [ceil(N/128), ceil(K/128)],
    w[n, k] = fp8[n, k] * scale[n // 128, k // 128]  (Qwen FP8 checkpoints' weight_scale_inv)
Computed in fp32, rounded once to x's dtype.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 128  # rows and columns per block scale in Qwen's FP8 checkpoints


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor | None) -> torch.Tensor:
    """weight [N, K] (+ its scales) -> fp32 [N, K]."""
    w = weight.float()
    if weight_scale is None:
        return w
    if weight_scale.dim() == 1:
        return w * weight_scale.float()[:, None]
    n, k = w.shape
    per_row = weight_scale.float().repeat_interleave(SCALE_BLOCK, dim=0)[:n]
    return w * per_row.repeat_interleave(SCALE_BLOCK, dim=1)[:, :k]


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
