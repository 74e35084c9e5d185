"""x @ W^T for NVFP4 weights at any row count: the torch reference.

The weight layout (uint8 codes two a byte, e4m3 block scale per 16 codes, fp32 row scale) and
its dequantization are nvfp4_gemv/ref.py's. The reference is that module's product for any M:
the weight dequantized to fp32, one fp32 matmul, then x's dtype.
"""

from __future__ import annotations

import torch

from ninfer.kernels.nvfp4_gemv import ref as nvfp4_ref


def nvfp4_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    block_scale: torch.Tensor,
    row_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype: x in fp32 times the fp32 dequantized
    weight W [N, K], accumulated in fp32, rounded once."""
    return nvfp4_ref.gemv_nvfp4(x, weight, block_scale, row_scale, bias)
