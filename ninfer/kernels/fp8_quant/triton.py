"""Per-row FP8 quantization in Triton: two passes over the activations instead of the
reference's chain of elementwise kernels (abs, amax, casts, divide, clamp, convert), each
a full pass with fp32 intermediates.

Pass 1 writes each row's amax; the scales come from it through ref.row_scales (torch on
M values, the reference's own arithmetic, so the bits match on every device); pass 2
divides by the scale (round-to-nearest, as torch's tensor division), clamps and converts
with round-to-nearest-even, and writes the zero padding rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.fp8_quant.ref import FP8, FP8_MAX, row_scales


@triton.jit
def _row_amax_kernel(x_ptr, amax_ptr, K, stride_x, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + cols
        x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    tl.store(amax_ptr + row, tl.max(amax, 0))


@triton.jit
def _quantize_kernel(
    x_ptr, scale_ptr, out_ptr, num_rows, K, stride_x, stride_out, FP8_MAX_VALUE: tl.constexpr, BLOCK_K: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    valid = row < num_rows  # rows past num_rows are padding: zeros
    scale = tl.load(scale_ptr + row, mask=valid, other=1.0)
    cols = tl.arange(0, BLOCK_K)
    for start in range(0, K, BLOCK_K):
        k = start + cols
        x = tl.load(x_ptr + row * stride_x + k, mask=(k < K) & valid, other=0.0).to(tl.float32)
        # Round-to-nearest division, as torch's (Triton's fp32 "/" may approximate).
        q = tl.math.div_rn(x, tl.zeros([BLOCK_K], tl.float32) + scale)
        q = tl.minimum(tl.maximum(q, -FP8_MAX_VALUE), FP8_MAX_VALUE)
        tl.store(out_ptr + row * stride_out + k, q.to(tl.float8e4nv), mask=k < K)


def quantize_rows(x: torch.Tensor, row_multiple: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ref.quantize_rows (the same bits)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes [M, K], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    num_rows, K = x.shape
    padded = -(-num_rows // row_multiple) * row_multiple
    out = torch.empty((padded, K), dtype=FP8, device=x.device)
    amax = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return out, torch.ones((padded, 1), dtype=torch.float32, device=x.device)
    block_k = min(4096, triton.next_power_of_2(max(K, 16)))
    num_warps = 4 if block_k >= 1024 else 1
    _row_amax_kernel[(num_rows,)](x, amax, K, x.stride(0), BLOCK_K=block_k, num_warps=num_warps)
    scale = row_scales(amax)
    _quantize_kernel[(padded,)](
        x, scale, out, num_rows, K, x.stride(0), out.stride(0), FP8_MAX_VALUE=FP8_MAX, BLOCK_K=block_k,
        num_warps=num_warps,
    )
    if padded != num_rows:
        scale = torch.cat([scale, torch.ones((padded - num_rows, 1), dtype=torch.float32, device=x.device)])
    return out, scale
