"""Block-scaled FP8 GEMM in Triton for prefill: out[M, N] = x[M, K] @ W[N, K]^T on Hopper's
FP8 tensor cores, with the weight's block scales applied in the loop instead of a dequantized
bf16 copy of the weight (which cost an fp32 and a bf16 copy of every weight per prefill chunk).

Semantics: ref.py. Untuned: written without a GPU, so the tiles in `_config` come from
register and shared-memory arithmetic for the H200 (and the sm_90 build, which Triton makes
on a CPU machine), not from a measurement.

quantize_groups: one program per row and GROUPS_PER_PROGRAM groups of 128 columns, the whole
tile in registers: the groups' amax, the scale as fp8_quant's (clamp, then times the fp32
reciprocal of 448), round-to-nearest division, clamp, round-to-nearest-even conversion: the
reference's bits. The scales are written group-major (an [M, G] view of a [G, M] buffer) so
that the GEMM's loads of one group's scales for a tile's rows are contiguous.

block_fp8_matmul: a program owns a BLOCK_M x BLOCK_N output tile and walks K one scale group
(BLOCK_K = 128 columns) at a time: tl.dot of the two e4m3 tiles into a fresh fp32 tile, which
is multiplied by the rows' x scales and the columns' weight scales and added to the fp32
accumulator. Within a group the tensor cores accumulate in their own reduced precision (the
default for fp8 dots on sm_90); across groups the sum is a full fp32 one, so that reduced
precision never builds up over more than 128 columns. Rows and columns past the matrix re-read the last row or column (no load
masks in the loop) and are never stored; a partial last group is masked when K % 128 != 0.
Tiles are ordered in bands of BAND_M tile rows, column by column inside a band, so the
programs resident together share a band's x rows and a few weight column tiles in L2.
sm_90 build (tiles in TILES, 16-byte aligned rows): QGMMA, 16-byte cp.async loads pipelined
over num_stages, no spills; with K % 16 != 0 the rows are unaligned and it spills (correct,
slow; Qwen's K are multiples of 128).

Capture-safe: launch shapes come from tensor shapes only, no host syncs. No PDL: the kernel
runs at prefill sizes (and decode batches beyond gemv.MAX_ROWS), where a launch's drain is a
small part of a long matmul.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ninfer.kernels.backend import fast_version
from ninfer.kernels.fp8_gemm import cublas, ref
from ninfer.kernels.fp8_gemm.ref import num_groups
from ninfer.kernels.fp8_quant.ref import FP8, FP8_MAX, INV_FP8_MAX, MIN_AMAX
from ninfer.kernels.gemv.ref import SCALE_BLOCK, scale_rows_per_block
from ninfer.kernels.sm_count import device_sms

GROUPS_PER_PROGRAM = 8  # quantize_groups: 1024 columns per program, 16-byte bf16 loads on 4 warps


@triton.jit
def _quantize_groups_kernel(
    x_ptr, out_ptr, scale_ptr, K, groups_per_row,
    stride_x, stride_out, stride_scale_m, stride_scale_g,
    FP8_MAX_VALUE: tl.constexpr, INV_FP8_MAX_VALUE: tl.constexpr, MIN_AMAX_VALUE: tl.constexpr,
    GROUP: tl.constexpr, GROUPS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    in_row = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=in_row, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX_VALUE)
    scale = amax * INV_FP8_MAX_VALUE
    tl.store(scale_ptr + row * stride_scale_m + groups * stride_scale_g, scale, mask=groups < groups_per_row)
    # Round-to-nearest division, as torch's (Triton's fp32 "/" may approximate).
    q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], (GROUPS, GROUP)))
    q = tl.minimum(tl.maximum(q, -FP8_MAX_VALUE), FP8_MAX_VALUE)
    tl.store(out_ptr + row * stride_out + cols, q.to(tl.float8e4nv), mask=in_row)


@fast_version(ref.quantize_groups)
def quantize_groups(x):
    """Same contract as ref.quantize_groups (the same bits); the scales come as a
    non-contiguous [M, G] view (strides (1, M))."""
    if x.dim() != 2:
        raise ValueError(f"quantize_groups takes [M, K], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    groups = num_groups(cols)
    out = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scale = torch.empty((groups, rows), dtype=torch.float32, device=x.device).t()
    if rows == 0 or groups == 0:
        return out, scale
    per_program = min(GROUPS_PER_PROGRAM, triton.next_power_of_2(groups))
    _quantize_groups_kernel[(rows, triton.cdiv(groups, per_program))](
        x, out, scale, cols, groups,
        x.stride(0), out.stride(0), scale.stride(0), scale.stride(1),
        FP8_MAX_VALUE=FP8_MAX, INV_FP8_MAX_VALUE=INV_FP8_MAX, MIN_AMAX_VALUE=MIN_AMAX,
        GROUP=SCALE_BLOCK, GROUPS=per_program,
        num_warps=max(1, per_program // 2),
    )  # fmt: skip
    return out, scale


class Config(NamedTuple):
    """One launch shape: output tile block_m x block_n, warps, software-pipeline stages, and
    band_m tile rows per band of the tile order."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    band_m: int = 8


# In order of preference. 64 x 128 before 128 x 128, as measured (H100, 27B shapes,
# benchmarks/kernels/bench_prefill_gemm.py): 585 against 518 TFLOP/s on gate|up at 8,192 rows,
# 545 against 412 on 5120 x 6144, 453 against 328 at 1,024 rows. Registers: the fp32 accumulator
# and each group's fresh dot result take 2 * block_m * block_n / (32 * warps) per thread,
# 128 / 128 / 64 (sm_90 build: 200 / 255 / 162 in all, no spills); 128 x 256 would need 256 for
# the two tiles alone. Shared memory: (block_m + block_n) * 128 bytes per stage, 4 stages =
# 96 / 128 / 64 KiB of the 227 KiB. Warps: one warpgroup per 64 rows (wgmma's M).
TILES = (
    Config(64, 128, 4, 4),
    Config(128, 128, 8, 4),
    Config(64, 64, 4, 4),
)


@functools.cache
def _config(M: int, N: int, num_sms: int) -> Config:
    """The first tile of TILES that fills every SM once (at least num_sms tiles), else the
    smallest (few rows: the weight is streamed, and more, narrower programs read it sooner);
    128-row tiles only from 65 rows. 27B prefill at M >= 1024 takes 64 x 128 on every
    projection."""
    fitting = [tile for tile in TILES if tile.block_m <= max(64, triton.next_power_of_2(M))]
    for tile in fitting:
        if triton.cdiv(M, tile.block_m) * triton.cdiv(N, tile.block_n) >= num_sms:
            return tile
    return TILES[-1]




@triton.jit
def _block_fp8_matmul_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xs_m, stride_xs_g, stride_wn, stride_ws_n, stride_ws_g, stride_om,
    SCALE_ROWS: tl.constexpr,  # weight rows per weight_scale row: 1 (row blocks) or 128
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BAND_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_band = BAND_M * tiles_n
    band = pid // tiles_per_band
    first_tile_m = band * BAND_M
    band_rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_tile_m, BAND_M)  # the last band may be shorter
    in_band = pid - band * tiles_per_band
    tile_m = first_tile_m + in_band % band_rows
    tile_n = in_band // band_rows

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Rows and columns past the end read the last one again: no masks on the loop's loads.
    safe_rows = tl.minimum(rows, M - 1).to(tl.int64)
    safe_cols = tl.minimum(cols, N - 1).to(tl.int64)
    x_ptrs = x_ptr + safe_rows[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + safe_cols[None, :] * stride_wn + ks[:, None]  # W^T's [BLOCK_K, BLOCK_N] tile
    x_scale_ptrs = x_scale_ptr + safe_rows * stride_xs_m
    w_scale_ptrs = w_scale_ptr + (safe_cols // SCALE_ROWS) * stride_ws_n

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for group in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            cols_left = K - group * BLOCK_K
            a = tl.load(x_ptrs, mask=ks[None, :] < cols_left, other=0.0)
            b = tl.load(w_ptrs, mask=ks[:, None] < cols_left, other=0.0)
        x_scale = tl.load(x_scale_ptrs + group * stride_xs_g)
        w_scale = tl.load(w_scale_ptrs + group * stride_ws_g)
        # The group's exact e4m3 products summed by the tensor cores, scaled in fp32 (the
        # reference's order: x's scale, then the weight's).
        acc += tl.dot(a, b) * x_scale[:, None] * w_scale[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@fast_version(ref.block_fp8_matmul)
def block_fp8_matmul(x_fp8, x_scale, weight, weight_scale, out_dtype, bias=None, *, config: Config | None = None):
    """Config overrides the heuristic (tests, benchmarks).
    x_scale and weight_scale may have any strides."""
    rows, cols = x_fp8.shape
    if x_fp8.dtype != FP8 or weight.dtype != FP8:
        raise ValueError(f"x_fp8 and weight must be {FP8}, got {x_fp8.dtype} and {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != cols:
        raise ValueError(f"weight must be [N, {cols}], got {tuple(weight.shape)}")
    groups = num_groups(cols)
    if tuple(x_scale.shape) != (rows, groups):
        raise ValueError(f"x_scale must be [{rows}, {groups}], got {tuple(x_scale.shape)}")
    scale_rows = scale_rows_per_block(weight, weight_scale)
    if scale_rows is None:
        raise ValueError(
            f"weight_scale {tuple(weight_scale.shape)} fits no block layout of weight {tuple(weight.shape)}"
        )
    N = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"bias must be [{N}], got {tuple(bias.shape)}")
    if rows == 0 or N == 0 or cols == 0:
        return ref.block_fp8_matmul(x_fp8, x_scale, weight, weight_scale, out_dtype, bias)  # no K step to run
    cfg = config or _config(rows, N, device_sms(x_fp8.device))
    if cfg.block_m < 16 or cfg.block_n < 16 or cfg.band_m < 1:
        raise ValueError(f"invalid config {cfg}")
    x_fp8 = x_fp8 if x_fp8.stride(1) == 1 else x_fp8.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    x_scale, weight_scale = x_scale.float(), weight_scale.float()  # no copies for fp32 scales
    bias = None if bias is None else bias.contiguous()
    out = torch.empty((rows, N), dtype=out_dtype, device=x_fp8.device)
    grid = (triton.cdiv(rows, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _block_fp8_matmul_kernel[grid](
        x_fp8, x_scale, weight, weight_scale,
        out if bias is None else bias,  # never read without HAS_BIAS
        out,
        rows, N, cols,
        x_fp8.stride(0), x_scale.stride(0), x_scale.stride(1),
        weight.stride(0), weight_scale.stride(0), weight_scale.stride(1), out.stride(0),
        SCALE_ROWS=scale_rows, HAS_BIAS=bias is not None, EVEN_K=cols % SCALE_BLOCK == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=SCALE_BLOCK, BAND_M=cfg.band_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


# fp8_linear takes cuBLAS's blockwise product where the probe passes: 1.6-1.8x the Triton kernel at
# the 27B's prefill shapes (H100, benchmarks/kernels/bench_prefill_gemm.py prints both).
CUBLAS_BY_DEFAULT = True


@fast_version(ref.fp8_linear)
def fp8_linear(x, weight, weight_scale, bias=None, *, config: Config | None = None, use_cublas: bool | None = None):
    """quantize_groups, then the product: with use_cublas (default CUBLAS_BY_DEFAULT), cuBLAS's
    blockwise FP8 GEMM where this torch and device have it (cublas.py), else block_fp8_matmul.
    config: the Triton kernel with that launch shape (tests, benchmarks)."""
    use_cublas = CUBLAS_BY_DEFAULT if use_cublas is None else use_cublas
    x_fp8, x_scale = quantize_groups(x)
    if (use_cublas and config is None and cublas.eligible(x_fp8, weight, weight_scale)
            and cublas.supported(x_fp8.device, weight, weight_scale)):  # fmt: skip
        return cublas.matmul(x_fp8, x_scale, weight, weight_scale, x.dtype, bias)
    return block_fp8_matmul(x_fp8, x_scale, weight, weight_scale, x.dtype, bias, config=config)
