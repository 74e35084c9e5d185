"""Per-row FP8 quantization in Triton: one launch instead of the reference's chain of
elementwise kernels (abs, amax, casts, scale, divide, clamp, convert, padding), each a full
pass with fp32 intermediates.

One program per (padded) row: a first loop takes the row's amax, the scale is the
reference's product (clamp, then times the fp32 reciprocal of 448), and a second loop
re-reads the row (from cache), divides with round-to-nearest as torch's tensor division,
clamps and converts with round-to-nearest-even. Programs past the last row write the zero
padding rows and their scale 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.backend import fast_version
from ninfer.kernels.fp8_quant import ref
from ninfer.kernels.fp8_quant.ref import FP8, FP8_MAX, INV_FP8_MAX, MIN_AMAX


@triton.jit
def _quantize_rows_kernel(
    x_ptr, out_ptr, scale_ptr, num_rows, K, stride_x, stride_out,
    FP8_MAX_VALUE: tl.constexpr, INV_FP8_MAX_VALUE: tl.constexpr, MIN_AMAX_VALUE: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    valid = row < num_rows  # rows past num_rows are padding: zeros, scale 1
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + cols
        x = tl.load(x_ptr + row * stride_x + k, mask=(k < K) & valid, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    row_amax = tl.maximum(tl.max(amax, 0), MIN_AMAX_VALUE)
    scale = tl.where(valid, row_amax * INV_FP8_MAX_VALUE, 1.0)
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK_K):
        k = start + cols
        x = tl.load(x_ptr + row * stride_x + k, mask=(k < K) & valid, other=0.0).to(tl.float32)
        # Round-to-nearest division, as torch's (Triton's fp32 "/" may approximate).
        q = tl.math.div_rn(x, tl.zeros([BLOCK_K], tl.float32) + scale)
        q = tl.minimum(tl.maximum(q, -FP8_MAX_VALUE), FP8_MAX_VALUE)
        tl.store(out_ptr + row * stride_out + k, q.to(tl.float8e4nv), mask=k < K)


@fast_version(ref.quantize_rows)
def quantize_rows(x, row_multiple=16):
    """Same contract as ref.quantize_rows (the same bits)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes [M, K], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    num_rows, K = x.shape
    padded = -(-num_rows // row_multiple) * row_multiple
    out = torch.empty((padded, K), dtype=FP8, device=x.device)
    scale = torch.empty((padded, 1), dtype=torch.float32, device=x.device)
    if padded == 0:
        return out, scale
    block_k = min(4096, triton.next_power_of_2(max(K, 16)))
    _quantize_rows_kernel[(padded,)](
        x, out, scale, num_rows, K, x.stride(0), out.stride(0),
        FP8_MAX_VALUE=FP8_MAX, INV_FP8_MAX_VALUE=INV_FP8_MAX, MIN_AMAX_VALUE=MIN_AMAX, BLOCK_K=block_k,
        num_warps=4 if block_k >= 1024 else 1,
    )
    return out, scale
