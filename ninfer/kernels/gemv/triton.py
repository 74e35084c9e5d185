"""Skinny matmul out[M, N] = x[M, K] @ W[N, K]^T for decode batches (M <= 32), bf16 or FP8 weights.

One file past the usual size on purpose: the FMA, DOT and split-K paths, the two epilogues and
the launch heuristic share tile helpers and one config table, and are tuned together.

At M <= 32 the product is a pure weight stream: 2 * M FLOP per weight element against
1-2 bytes read, far under the H200's ~200 FLOP/byte ridge, so the goal is to read W once
at HBM bandwidth. Each program owns BLOCK_N whole output columns (all M rows) and walks K
in BLOCK_K steps, so every output is one fixed-order fp32 sum: no atomics, the same bits
every run. Weight tiles are read as 16-byte vectors along K (8 bf16 or 16 fp8 values per
thread); the few x rows stay in L1/L2.

Two inner products, picked per M by `_config`:
  - FMA (small M): the weight tile is [BLOCK_K / VEC, BLOCK_N, VEC]; each thread
    multiplies its 16-byte vectors by the matching x values of every row and sums the VEC
    products in registers, so cross-thread reductions happen once per program, at the end.
    M FMAs per weight element on the CUDA cores: the default up to M = 2 (bf16) or 1 (FP8,
    whose conversion costs 1.5 instructions per element on top).
  - DOT (larger M): tl.dot on the tensor cores (cp.async-pipelined tiles), so the cost per
    weight element no longer grows with M. bf16 weights: x padded to 16 (or 32) rows is the
    MMA's A operand. FP8 weights: the weight tile is the A operand (16 rows per warp), x^T the
    B operand padded to 8 (M <= 8), 16 or 32 columns; rows of x past M are never read.

FP8 (weight-only): the e4m3 bytes are converted in registers, exactly: to fp32 through
fp16 for FMA (packed cvt, then one f16 -> f32 per element); by bit moves for DOT (sign to
the top, exponent and mantissa to the bottom of bf16's fields: the value times 2^-120,
subnormals included, 1.5 instructions per element; inline PTX, the CPU interpreter uses
the same bit moves in Triton ops), with x multiplied by 2^64 (exact) to keep products in
fp32's normal range and 2^56 folded into the scale. A per-channel scale multiplies each
column sum once at the end; a block scale multiplies each partial sum that lies in one
128-wide K block (a VEC vector for FMA, a <= 128-wide tensor-core slice for DOT). Block
scales come in two layouts (ref.scale_rows_per_block): 128 x 128 blocks, scale row
n // 128, or row blocks [N, ceil(K/128)], scale row n (packed projections whose parts'
128-row blocks do not line up); the kernels index row n // SCALE_ROWS (constexpr 128 or 1)
and load a [BLOCK_N] vector of scales per 128-wide K block either way, so the 128 x 128
build is unchanged. Row blocks read 4 bytes of scale per 128 weights (+3 % over FP8 weights).
e4m3 NaN codes are not handled (checkpoints clamp to +-448).

Small N: programs own fewer columns (down to one) before K is split; a split-K launch
writes fp32 partials [SPLIT_K, M, N] that a second kernel sums in split order (still
deterministic). Launch shapes come from shapes and dtypes only (cached), outputs are
torch.empty: capture-safe for CUDA graphs. Both kernels launch with programmatic
dependent launch where ninfer.kernels.pdl allows it (sm_90+, NINFER_PDL != 0): each waits
in pdl_sync for the previous kernel before its first load of x; the FMA path loads its first
weight tile before that wait (Config.prefetch: the weight is read-only for the chain).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ninfer.kernels.activation.triton import silu_and_mul, silu_mul
from ninfer.kernels.backend import fast_version
from ninfer.kernels.gemv import conv_first_columns
from ninfer.kernels.gemv import ref
from ninfer.kernels.gemv.ref import FP8, MAX_ROWS, SCALE_BLOCK, scale_rows_per_block
from ninfer.kernels.pdl import pdl_enabled, pdl_sync
from ninfer.kernels.sm_count import device_sms

DOT_ROWS = 16  # DOT programs with 16-bit weights pad x to 16 rows (the MMA's M), above 16 to 32
FP8_DOT_ROWS = 8  # ... with FP8 weights to 8 (x^T is the MMA's N operand)
_SCALE_NONE, _SCALE_CHANNEL, _SCALE_BLOCK = 0, 1, 2


class Config(NamedTuple):
    """One launch shape. block_k: K elements per loop step; split_k: programs along K;
    prefetch (FMA): load the first weight tile before the PDL wait.
    FP8 DOT: block_n >= 16 (the MMA's rows), best a multiple of 16 * num_warps (else the
    warps split x's columns and each converts the same weights)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    use_dot: bool = False
    split_k: int = 1
    prefetch: bool = False


@triton.constexpr_function
def _bits_exp(dtype):
    """_e4m3_bits(w, dtype) is w * 2^-_bits_exp(dtype): dtype's exponent bias minus e4m3's (7)."""
    return 8 if dtype == tl.float16 else 120


@triton.constexpr_function
def _x_exp(dtype):
    """FP8 DOT multiplies x by 2^_x_exp (exact) so that products stay clear of fp32's
    subnormal range (see _dot_tile); fp16 x has no room for it and needs none."""
    return 0 if dtype == tl.float16 else 64


@triton.jit
def _e4m3_bits(w, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """e4m3 -> DTYPE (bf16, fp16 or fp32) by moving bits: the value times 2^-_bits_exp(DTYPE).

    The sign goes to the top bit and the 4 exponent + 3 mantissa bits to the bottom of
    DTYPE's exponent field and the top of its mantissa field: (sext(b) << S) & mask with
    S = 4 (bf16), 7 (fp16) or 20 (fp32). The exponent bias is DTYPE's (127 or 15) instead of
    7, a power of two that the caller folds into the scale it applies to the fp32 sums.
    Subnormals map to subnormals (e4m3 exponent 0 is DTYPE's exponent 0), zeros to zeros.
    NaN (0x7F / 0xFF) would become a finite value: FP8 checkpoints never hold it
    (quantization clamps to +-448).

    ASM (bf16 only, compiled kernels): 4 values per 32-bit register in 6 instructions, 1.5
    per value: prmt with sign replication (selector nibbles 8-B) makes each pair of bytes
    two sign-extended 16-bit halves, then one shift and one mask per pair (the previous
    version moved the same bits in 2 and multiplied by 2^120 in 0.5 more). The same ops
    written in Triton ops compile to ~3 per value (bytes widened one by one). is_pure lets
    Triton convert after its shared-memory load of the FP8 tile, in the MMA operand layout
    (not through a second bf16 copy of the tile in shared memory).
    """
    if ASM and DTYPE == tl.bfloat16:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 lo, hi;
            prmt.b32 lo, $2, 0, 0x9180;
            prmt.b32 hi, $2, 0, 0xB3A2;
            shl.b32 lo, lo, 4;
            shl.b32 hi, hi, 4;
            and.b32 $0, lo, 0x87F087F0;
            and.b32 $1, hi, 0x87F087F0;
            }""",
            constraints="=r,=r,r",
            args=[w.to(tl.uint8, bitcast=True)],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )
    b = w.to(tl.int8, bitcast=True).to(tl.int32)  # sign-extended
    if DTYPE == tl.float32:
        return ((b << 20) & -0x78100000).to(tl.float32, bitcast=True)  # mask 0x87F00000
    elif DTYPE == tl.float16:
        return ((b << 7) & 0xBF80).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return ((b << 4) & 0x87F0).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_fp32(w):
    if w.dtype == tl.float8e4nv:
        # Through fp16 (exact for e4m3): packed cvt.rn.f16x2.e4m3x2 for each pair, then one
        # f16 -> f32 per element, 1.5 instructions per element (sm_90 build); the direct
        # cast converts element by element. _e4m3_bits' route to fp32 (sign-extending prmt
        # per pair, then shift and mask for each element) costs 2.5: at M = 1 the loop went
        # from 3.3 to 4.4 instructions per weight byte, so FMA keeps this one.
        w = w.to(tl.float16)
    return w.to(tl.float32)


@triton.jit
def _load_x(x_ptrs, k0, r, K, VEC: tl.constexpr, VEC_X: tl.constexpr, EVEN_K: tl.constexpr):
    if EVEN_K:
        xt = tl.load(x_ptrs)
    else:
        xt = tl.load(x_ptrs, mask=(k0 + r[:, None, None, None] * VEC + tl.arange(0, VEC_X)[None, None, None, :]) < K, other=0.0)
    return xt.to(tl.float32)


@triton.jit
def _load_w(w_ptrs, k0, k_in_tile, K, EVEN_K: tl.constexpr):
    """The [R, 1, BLOCK_N, VEC] weight tile at k0 (zeros past K)."""
    if EVEN_K:
        return tl.load(w_ptrs)
    return tl.load(w_ptrs, mask=(k0 + k_in_tile) < K, other=0.0)


@triton.jit
def _fma_part(
    w,
    x_ptrs,
    scale_ptr,
    n_load,
    k0,
    r,
    K,
    stride_sn,
    SCALE: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VEC: tl.constexpr,
    SPLIT_X: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """One step of _fma_tile: the loaded weight tile times x -> [R, BLOCK_M, BLOCK_N] sums of VEC products."""
    R: tl.constexpr = w.shape[0]
    VEC_X: tl.constexpr = VEC // SPLIT_X
    w = _to_fp32(w)
    if SPLIT_X == 1:
        part = tl.sum(_load_x(x_ptrs, k0, r, K, VEC, VEC_X, EVEN_K) * w, axis=3)
    else:
        # Split each thread's VEC weights into halves in registers (no data movement).
        w_lo, w_hi = tl.split(tl.permute(tl.reshape(w, [R, 1, BLOCK_N, 2, VEC_X]), [0, 1, 2, 4, 3]))
        part = tl.sum(_load_x(x_ptrs, k0, r, K, VEC, VEC_X, EVEN_K) * w_lo, axis=3)
        part += tl.sum(_load_x(x_ptrs + VEC_X, k0 + VEC_X, r, K, VEC, VEC_X, EVEN_K) * w_hi, axis=3)
    if SCALE == 2:
        # A VEC-wide vector never straddles a 128-wide K block. Clamped: masked tails
        # past K would name a block column that does not exist (their sums are 0).
        # Scale row n // SCALE_ROWS: 128 x 128 blocks (128) or row blocks (1).
        kb = tl.minimum((k0 + r * VEC) // 128, (K - 1) // 128)
        s = tl.load(scale_ptr + (n_load // SCALE_ROWS)[None, :] * stride_sn + kb[:, None])
        part = part * s[:, None, :]
    return part


@triton.jit
def _fma_tile(
    x_ptr,
    w_ptr,
    scale_ptr,
    m_load,
    n_load,
    k_start,
    k_end,
    K,
    stride_xm,
    stride_sn,
    SCALE: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,
    SPLIT_X: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """-> fp32 [BLOCK_M, BLOCK_N]: sum over k in [k_start, k_end) of x[m, k] * w[n, k] (block-scaled).

    Waits for the previous kernel (pdl_sync) before reading x. PREFETCH: the weight is
    read-only for the whole launch chain, so the first weight tile is loaded before that
    wait: its bytes stream in while the previous kernel (in a decode step a short, latency-
    bound one) runs, instead of after it. The sums are the same, in the same order.
    """
    R: tl.constexpr = BLOCK_K // VEC
    r = tl.arange(0, R)
    v = tl.arange(0, VEC)
    # Tiles are 4-D over (vector r, row m, column n, element v): x [R, BLOCK_M, 1, VEC] and
    # W [R, 1, BLOCK_N, VEC], pointers built in that shape. Putting R first makes Triton
    # spread threads along R for both loads (one warp reads 32 consecutive 16-byte vectors
    # of a weight row), so x arrives already in the weight's layout (no shared-memory
    # conversion in the loop) and the VEC axis stays inside one thread.
    k_in_tile = r[:, None, None, None] * VEC + v[None, None, None, :]
    w_ptrs = w_ptr + n_load.to(tl.int64)[None, None, :, None] * K + (k_start + k_in_tile).to(tl.int64)
    # x is read as SPLIT_X pieces of VEC // SPLIT_X (16 bytes each when the weight is FP8
    # and x is bf16), so each x load keeps the weight's thread layout.
    VEC_X: tl.constexpr = VEC // SPLIT_X
    kx = (k_start + r[:, None, None, None] * VEC + tl.arange(0, VEC_X)[None, None, None, :]).to(tl.int64)
    x_ptrs = x_ptr + m_load[None, :, None, None] * stride_xm + kx
    # Per (vector, row, column) sums: the VEC products are summed in registers every step,
    # the R vectors of a column only once after the loop.
    acc = tl.zeros([R, BLOCK_M, BLOCK_N], dtype=tl.float32)
    loop_start = k_start
    if PREFETCH:
        w_first = _load_w(w_ptrs, k_start, k_in_tile, K, EVEN_K)
    pdl_sync(USE_PDL)  # x comes from the previous kernel
    if PREFETCH:
        # Splits are never empty (gemv sizes them), so the first step always exists.
        acc += _fma_part(w_first, x_ptrs, scale_ptr, n_load, k_start, r, K, stride_sn,
                         SCALE, SCALE_ROWS, BLOCK_N, VEC, SPLIT_X, EVEN_K)  # fmt: skip
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        loop_start += BLOCK_K
    for k0 in range(loop_start, k_end, BLOCK_K):
        w = _load_w(w_ptrs, k0, k_in_tile, K, EVEN_K)
        acc += _fma_part(w, x_ptrs, scale_ptr, n_load, k0, r, K, stride_sn,
                         SCALE, SCALE_ROWS, BLOCK_N, VEC, SPLIT_X, EVEN_K)  # fmt: skip
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return tl.sum(acc, axis=0)


@triton.jit
def _dot_tile(
    x_ptr,
    w_ptr,
    scale_ptr,
    m,
    M,
    n_load,
    k_start,
    k_end,
    K,
    stride_xm,
    stride_sn,
    SCALE: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_SUB: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_M: tl.constexpr,
    FP8_ASM: tl.constexpr,
):
    """DOT version of _fma_tile: tensor-core products of K_SUB-wide slices (K_SUB <= 128 with
    block scales), fp32 [BLOCK_M, BLOCK_N].

    16-bit weights: acc[BLOCK_M, BLOCK_N] += x @ W^T, x the MMA's A operand (16 or 32 rows).
    FP8 weights: acc[BLOCK_N, BLOCK_M] += W @ x^T, the weight tile the A operand: 16 weight
    rows per warp and MMA (block_n = 16 * num_warps, or a multiple), x padded only to 8 rows
    for M <= 8. Triton then converts each weight value once, after its shared-memory load
    and in the operand layout, and each warp reads x^T as ready 2-register B fragments.

    FP8 arithmetic: W' = e4m3 * 2^-120 (bf16 bit moves, _e4m3_bits) and x' = x * 2^64 are
    exact, so each product is x * w * 2^-56: clear of fp32's subnormal range unless
    |x * w| < 2^-70 (in e4m3 units), whatever the tensor cores do with subnormals. The
    sums are multiplied back by 2^56 (FOLD) with the scale. fp16 x: W' = e4m3 * 2^-8,
    x unscaled (fp16 has no range to spare), FOLD = 2^8.
    """
    FP8: tl.constexpr = w_ptr.dtype.element_ty == tl.float8e4nv
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    X_SCALE: tl.constexpr = 2.0 ** _x_exp(X_DTYPE)
    FOLD: tl.constexpr = 2.0 ** (_bits_exp(X_DTYPE) - _x_exp(X_DTYPE))
    kk = tl.arange(0, K_SUB)
    w_ptrs = w_ptr + n_load.to(tl.int64)[:, None] * K + (k_start + kk)[None, :]
    x_ptrs = x_ptr + m[:, None] * stride_xm + (k_start + kk)[None, :]
    # Rows past M load zeros without reading memory (the mask is uniform along K, so the
    # loads stay 16-byte vectors); EVEN_M (M == BLOCK_M) drops the mask's per-load predicates.
    m_mask = (m < M)[:, None]
    if FP8:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    last_kb = (K - 1) // 128
    for k0 in range(k_start, k_end, BLOCK_K):
        for j in tl.static_range(BLOCK_K // K_SUB):
            if EVEN_K:
                w = tl.load(w_ptrs + j * K_SUB)
                if EVEN_M:
                    xt = tl.load(x_ptrs + j * K_SUB)
                else:
                    xt = tl.load(x_ptrs + j * K_SUB, mask=m_mask, other=0.0)
            else:
                k_mask = (k0 + j * K_SUB + kk) < K
                w = tl.load(w_ptrs + j * K_SUB, mask=k_mask[None, :], other=0.0)
                xt = tl.load(x_ptrs + j * K_SUB, mask=m_mask & k_mask[None, :], other=0.0)
            # Exact conversions; fp32 x keeps full fp32 products (no tf32).
            if FP8:
                w = _e4m3_bits(w, X_DTYPE, FP8_ASM)
                if X_SCALE != 1.0:
                    # One packed multiply per 2 x values after their shared-memory load: it
                    # also writes the B fragments in place (no register moves), for free.
                    xt = xt * X_SCALE
                if SCALE == 2:
                    part = tl.dot(w, tl.trans(xt), input_precision="ieee")
                    kb = tl.minimum((k0 + j * K_SUB) // 128, last_kb)
                    # [BLOCK_N] scales of this K block: row n // SCALE_ROWS (128 x 128 or row blocks)
                    s = tl.load(scale_ptr + (n_load // SCALE_ROWS) * stride_sn + kb) * FOLD  # finite: scales < 2^72
                    acc += part * s[:, None]
                else:
                    acc = tl.dot(w, tl.trans(xt), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, tl.trans(w.to(X_DTYPE)), acc, input_precision="ieee")
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if FP8:
        if SCALE != 2:
            acc = acc * FOLD  # exact: the sums in e4m3 units, before the channel scale
        acc = tl.trans(acc)
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    conv_w_ptr,
    conv_state_ptr,
    slots_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_sn,
    stride_cw,
    stride_slot,
    stride_sc,
    conv_channels,
    k_per_split,
    SCALE: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,
    SPLIT_X: tl.constexpr,
    K_SUB: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_M: tl.constexpr,
    FP8_ASM: tl.constexpr,
    PREFETCH: tl.constexpr,
    GLU: tl.constexpr,
    CONV_K: tl.constexpr,
    STATE_COLS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """GLU: W is gate | up (N / 2 rows each) and out[M, N / 2] = silu(gate) * up. A program's
    BLOCK_N rows are BLOCK_N / 2 gate rows and the up rows of the same columns, so the
    epilogue pairs them in registers (no split-K: gemv falls back to two launches).
    CONV_K > 0: the first conv_channels columns of each row go through the decode step of a
    depthwise causal conv of width CONV_K + silu, with row m's state in slot slots[m]
    (gemv_causal_conv1d_update); a program owns whole columns, so each state element is read
    and written by one thread. No split-K either."""
    pid_k = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    # Clamped indices: rows past N (or, for FMA, M) re-read the last real one, so the loads
    # need no masks and keep their 16-byte vectors; only the store is masked. DOT masks x's
    # padding rows instead (up to 12 of 16: not worth reading).
    if GLU:
        HALF: tl.constexpr = BLOCK_N // 2
        inter = N // 2
        idx = tl.arange(0, BLOCK_N)
        n_load = tl.minimum(tl.program_id(0) * HALF + idx % HALF, inter - 1) + (idx // HALF) * inter
    else:
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_load = tl.minimum(n, N - 1)
    m_load = tl.minimum(m, M - 1)
    if CONV_K > 0:
        # Before the weight stream (and, FMA, before the PDL wait): the slots, the conv weights
        # and the conv state, which only this kernel writes (a step earlier).
        j = tl.arange(0, STATE_COLS)
        is_conv = (n < conv_channels) & (n < N)
        c = tl.minimum(n, conv_channels - 1)
        slot = tl.load(slots_ptr + m_load).to(tl.int64)
        p_state = conv_state_ptr + slot[:, None] * stride_slot + c[None, :] * stride_sc  # [BLOCK_M, BLOCK_N]
        state_mask = (m[:, None] < M) & is_conv[None, :]
        tap_mask = (j < CONV_K - 1)[None, :]
        state = tl.load(p_state[:, :, None] + j[None, None, :], mask=state_mask[:, :, None] & tap_mask[None, :, :], other=0.0)
        state = state.to(tl.float32)
        w_old = tl.load(conv_w_ptr + c[:, None] * stride_cw + j[None, :], mask=is_conv[:, None] & tap_mask, other=0.0)
        w_old = w_old.to(tl.float32)
        w_new = tl.load(conv_w_ptr + c * stride_cw + (CONV_K - 1), mask=is_conv, other=0.0).to(tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if USE_DOT:
        pdl_sync(USE_PDL)  # x (and anything else) may come from the previous kernel
        acc = _dot_tile(
            x_ptr, w_ptr, scale_ptr, m, M, n_load, k_start, k_end, K, stride_xm, stride_sn,
            SCALE, SCALE_ROWS, BLOCK_M, BLOCK_N, BLOCK_K, K_SUB, EVEN_K, EVEN_M, FP8_ASM,
        )  # fmt: skip
    else:
        acc = _fma_tile(
            x_ptr, w_ptr, scale_ptr, m_load, n_load, k_start, k_end, K, stride_xm, stride_sn,
            SCALE, SCALE_ROWS, BLOCK_M, BLOCK_N, BLOCK_K, VEC, SPLIT_X, EVEN_K, PREFETCH, USE_PDL,
        )  # fmt: skip
    if SCALE == 1:
        acc = acc * tl.load(scale_ptr + n_load)[None, :]
    if GLU:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n_load).to(tl.float32)[None, :]
        # gate and up rounded to x's dtype, as the plain GEMV's output that silu_and_mul reads
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, HALF]), [0, 2, 1]))
        cols = tl.program_id(0) * HALF + tl.arange(0, HALF)
        act = silu_mul(gate, up, out_ptr.dtype.element_ty)
        mask = (m[:, None] < M) & (cols[None, :] < inter)
        tl.store(out_ptr + m[:, None] * stride_om + cols[None, :], act.to(out_ptr.dtype.element_ty), mask=mask)
    elif SPLIT:
        # fp32 partial of split pid_k; _split_sum_kernel adds the splits in order.
        mask = (m[:, None] < M) & (n[None, :] < N)
        tl.store(out_ptr + (pid_k * M + m[:, None]) * N + n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n_load).to(tl.float32)[None, :]
        if CONV_K > 0:
            # The projection rounded to x's dtype (what the conv kernel would read), then that
            # kernel's sum in its order: the new input's tap, then state column m (the input
            # K-1-m steps back) times tap m, which moves to column m-1 after this token.
            proj = acc.to(out_ptr.dtype.element_ty)
            conv = proj.to(tl.float32) * w_new[None, :]
            for col in tl.static_range(CONV_K - 1):
                s_col = tl.sum(tl.where(j[None, None, :] == col, state, 0.0), axis=2)  # column col, exactly
                conv += s_col * tl.sum(tl.where(j[None, :] == col, w_old, 0.0), axis=1)[None, :]
                if col > 0:
                    tl.store(p_state + (col - 1), s_col.to(conv_state_ptr.dtype.element_ty), mask=state_mask)
            tl.store(p_state + (CONV_K - 2), proj.to(conv_state_ptr.dtype.element_ty), mask=state_mask)
            acc = tl.where(is_conv[None, :], conv * tl.sigmoid(conv), proj.to(tl.float32))
        mask = (m[:, None] < M) & (n[None, :] < N)
        tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_sum_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    m = tl.program_id(1)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    pdl_sync(USE_PDL)  # the partials are the previous kernel's
    acc = tl.load(part_ptr + m * N + n, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + (s * M + m) * N + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, use_pdl: bool) -> None:
    """out[M, N] = the fp32 partials [SPLIT_K, M, N] summed in split order (+ bias): the second
    launch of every split-K GEMV."""
    split_k, M, N = partials.shape
    block = min(1024, triton.next_power_of_2(N))
    _split_sum_kernel[(triton.cdiv(N, block), M)](
        partials, partials if bias is None else bias, out, M, N, out.stride(0),
        SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=block, USE_PDL=use_pdl, num_warps=4, launch_pdl=use_pdl,
    )  # fmt: skip


def _block_m(M: int, use_dot: bool, fp8: bool) -> int:
    """Rows of x per program: FMA its power of two; DOT 16 or 32 (x is the MMA's A operand),
    or with FP8 weights (x^T is the B operand, 8 columns per MMA) 8 up to M = 8."""
    if not use_dot:
        return triton.next_power_of_2(M)
    return max(FP8_DOT_ROWS if fp8 else DOT_ROWS, triton.next_power_of_2(M))


def _pow2_floor(value: int) -> int:
    return 1 << (max(1, value).bit_length() - 1)


@functools.cache
def _config(M: int, N: int, K: int, weight_dtype: torch.dtype, num_sms: int, min_block_n: int = 1) -> Config:
    """Default launch shape: predictions for the H200 from the sm_90 build (instruction
    counts per weight byte); benchmarks/kernels/bench_gemv.py sweeps around it.
    min_block_n: 2 for the gate|up epilogue (a program needs a gate and an up row)."""
    elem_bytes = torch.empty((), dtype=weight_dtype).element_size()
    fp8 = weight_dtype == FP8
    # Issue-rate model from the sm_90 build: loop instructions (per thread) per weight byte;
    # an SM must take 16.5 bytes per clock at 4.3 TB/s and issues 128 thread-instructions
    # per clock, so x instructions per byte need x * 13 % of the issue rate.
    #   FMA bf16: 1.9 / 2.9 / 4.6 at M = 1 / 2 / 4; FMA FP8: 3.3 / 4.9 / 8.2 (M FMAs plus
    #     1.5 for the fp16 route per value: the bit-move route to fp32 costs 2.5, see _to_fp32).
    #   DOT bf16: 1.1-1.4 at any M; DOT FP8 (bit-move conversion, 1.5 per value): 2.25-2.45
    #     at M <= 8 and 2.65-2.8 at M = 16 with 32 weight rows per warp (2.7-3.4 with 16);
    #     it was 4.4-4.75 (bf16 copy of the tile through shared memory, 2.5 per value).
    # FP8 takes DOT from M = 3, and at M = 2 below N = 4096 (FMA at M = 2 is 4.9, but DOT
    # measured slower on every 27B shape); at M = 1 FMA's 3.3 vs DOT's ~2.4 is no reason to
    # leave FMA, measured at 91 % of copy bandwidth on the large shapes.
    # fp32 stays on FMA (exact fp32 products, no tf32).
    use_dot = elem_bytes < 4 and M > (1 if fp8 else 2)
    if fp8 and M == 2 and N >= 4096:
        # Measured on the H200 (bench_gemv, 27B shapes): FMA 10.7 vs DOT 12.5 us on 5120 x 6144, 25.1 vs
        # 30.6 on 5120 x 17408; in the decode chain DOT took 37 us per call on those two.
        use_dot = False
    target_programs = 4 * num_sms  # several resident programs per SM, short tails
    if use_dot:
        block_k = min(256, max(16, triton.next_power_of_2(K)))
        num_stages = 4  # cp.async pipelining: 3 tiles in flight per program
        if fp8:
            # 16 weight rows per warp and MMA (W is the A operand; 2 warps would otherwise
            # split x's columns and convert every weight twice), 32 per warp where possible
            # (two MMA tiles share each x fragment). x costs M * 2 / block_n bytes of L2
            # traffic per weight byte (rows past M are not read): 64 rows above M = 8, or
            # whenever the grid stays 2 programs per SM deep; 16 rows (1 warp) when
            # 32-row tiles leave SMs idle.
            if M > 8 or triton.cdiv(N, 64) >= 2 * num_sms:
                block_n, num_warps = 64, 2
            elif triton.cdiv(N, 32) >= target_programs:
                # Measured on the H200 (bench_gemv, M = 8): 16 rows beat 32 up to N = 16480 (27.1 vs 29.5 us).
                block_n, num_warps = 32, 1
            else:
                block_n, num_warps = 16, 1
        elif triton.cdiv(N, 64) >= 4 * target_programs:
            # 16-bit weights (x is the A operand, 8 weight columns per warp and MMA), lm_head-wide
            # matrices: 64 columns on 4 warps.
            block_n, num_warps = 64, 4
        elif M > DOT_ROWS and num_sms <= triton.cdiv(N, 64) < 3 * num_sms:
            # Measured (bench_gemv, H100, 27B shapes, M = 24 and 32): 64 columns where they make one
            # to three programs per SM (GDN in_proj, attention qkv: 8-15 % faster than 32 columns).
            block_n, num_warps, block_k, num_stages = 64, 2, 128, 3
        elif M > DOT_ROWS and triton.cdiv(N, 32) >= 4 * num_sms:
            # ... and 256-wide K steps 3 deep on the widest (MLP gate | up: 3 % faster than 128-wide).
            block_n, num_warps, block_k, num_stages = 32, 2, 256, 3
        else:
            # Measured (bench_gemv --wide, 27B shapes, M = 4 and 16): 32 columns on 2 warps, 128-wide
            # K steps 3 deep where N / 32 fills 2 programs per SM, else 256-wide 4 deep without
            # split-K: within 4 % of each shape's best, 97-104 % of the copy bandwidth, 2-10 %
            # ahead of cuBLAS; 16 columns below one program per SM.
            block_n, num_warps = (32, 2) if triton.cdiv(N, 32) >= num_sms else (16, 2)
            block_k, num_stages = (128, 3) if triton.cdiv(N, 32) >= 2 * num_sms else (min(block_k, 256), 4)
    else:
        vec = 16 // elem_bytes
        # One 16-byte vector per thread per row and step: block_k = vec * 32 * num_warps,
        # 2 KiB (bf16) or 1 KiB (FP8) of a row per step, dividing K where possible.
        block_k = min(1024, max(vec, triton.next_power_of_2(K)))
        while K % block_k and block_k > 256:
            block_k //= 2
        num_warps = max(1, min(4, block_k // (32 * vec)))
        # 4 rows: 4 x 16-byte loads in flight per thread per step; fewer for small N.
        block_n = 4
        if fp8 and K % 1024 == 0:
            # Measured at M = 1 (bench_gemv --wide, 27B shapes, PDL chain): wide matrices
            # (N / 8 > 5 programs per SM) are fastest as 1-warp programs of 2 rows x 1 KiB
            # steps (-1 to -3 % against 4 rows on 2 warps); narrow ones as 4-warp programs
            # of 8 rows x 2 KiB steps: 5120 x 6144 12.8 -> 9.7 us, 5120 x 17408 32.8 -> 23.6
            # (17 KiB rows: the last step is masked, still the fastest measured).
            if M == 2:
                # Measured at M = 2 (bench_gemv --wide, H200): the best single tile over
                # the 27B shapes, within 5 % of each shape's best.
                block_n, block_k, num_warps = 2, 1024, 2
            elif triton.cdiv(N, 8) > 5 * num_sms:
                block_n, block_k, num_warps = 2, 1024, 1
            else:
                block_n, block_k, num_warps = 8, 2048, 4
        while block_n > min_block_n and triton.cdiv(N, block_n) < target_programs:
            block_n //= 2
        num_stages = 1  # the FMA loop's loads are not pipelined by Triton: residency hides latency
    programs = triton.cdiv(N, block_n)
    split_k = 1
    # 16-bit DOT tiles from one program per SM stream at the copy bandwidth unsplit (measured).
    if programs < (num_sms if use_dot and (not fp8 or M > DOT_ROWS) else 2 * num_sms):
        # Under two programs per SM even with the narrowest tile: split K into fp32
        # partials (one more launch), keeping >= 2 steps per split.
        split_k = min(triton.next_power_of_2(triton.cdiv(2 * num_sms, programs)), _pow2_floor(K // (2 * block_k)))
    if use_dot and fp8 and M > DOT_ROWS and split_k > 1:
        # Measured (bench_gemv, H100, 27B shapes, M = 24 and 32): with K split only under one
        # program per SM (above), the split launches run best 3 stages deep (the unsplit, 4).
        num_stages = 3
    # FMA prefetch: the first weight tile before the PDL wait, so the stream starts while the
    # short kernel before the GEMV (a norm, the conv, silu * mul) runs.
    return Config(block_n, block_k, num_warps, num_stages, use_dot, split_k, prefetch=not use_dot)




@fast_version(ref.gemv)
def gemv(x, weight, weight_scale=None, bias=None, *, config: Config | None = None):
    """Same contract as ref.gemv for M <= MAX_ROWS; config overrides the heuristic (benchmarks)."""
    return _gemv(x, weight, weight_scale, bias, config, glu=False)


@fast_version(ref.gemv_silu_and_mul)
def gemv_silu_and_mul(x, weight, weight_scale=None, bias=None, *, config: Config | None = None):
    """Same contract as ref.gemv_silu_and_mul (the same bits as silu_and_mul(gemv(...)) with the
    same config): the activation in the FMA GEMV's epilogue, saving a launch per MLP at the
    one- and two-row decode sizes; tensor-core and split-K launches run the two kernels."""
    if weight.shape[0] % 2:
        raise ValueError(f"weight must be gate | up, got an odd {weight.shape[0]} rows")
    return _gemv(x, weight, weight_scale, bias, config, glu=True)


@fast_version(ref.gemv_causal_conv1d_update)
def gemv_causal_conv1d_update(
    x, weight, weight_scale, bias, conv_weight, conv_state, state_slots, *, config: Config | None = None
):
    """Same contract as ref.gemv_causal_conv1d_update (the same bits as the GEMV, then
    causal_conv1d_update on its first conv_weight.shape[0] columns, same config): the conv's
    decode step in the GEMV's epilogue, saving a launch per Gated DeltaNet layer."""
    channels, width = conv_weight.shape
    if channels > weight.shape[0] or conv_state.shape[1:] != (channels, width - 1) or conv_state.stride(2) != 1:
        raise ValueError(
            f"conv_weight {tuple(conv_weight.shape)} and conv_state {tuple(conv_state.shape)} must be [C, K] and"
            f" [slots, C, K-1] (unit last stride) with C <= {weight.shape[0]} output columns"
        )
    if state_slots.shape != (x.shape[0],):
        raise ValueError(f"state_slots {tuple(state_slots.shape)} must hold one slot per row of x {tuple(x.shape)}")
    return _gemv(x, weight, weight_scale, bias, config, glu=False, conv=(conv_weight, conv_state, state_slots))


def _gemv(x, weight, weight_scale, bias, config, glu: bool, conv=None) -> torch.Tensor:
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {M}")
    if weight.shape[1] != K or weight.stride(1) != 1 or weight.stride(0) != K:
        raise ValueError("weight must be a contiguous [N, K] matrix")
    if x.stride(1) != 1:
        x = x.contiguous()
    fp8 = weight.dtype == FP8
    if not fp8 and weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must be x's ({x.dtype}) or float8_e4m3fn")
    if fp8 != (weight_scale is not None):
        raise ValueError("FP8 weights need weight_scale, other weights take none")
    out = torch.empty((M, N // 2 if glu else N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    scale_kind = _SCALE_NONE
    scale_rows = SCALE_BLOCK  # block scales: weight row n uses scale row n // scale_rows
    stride_sn = 0
    if weight_scale is not None:
        if weight_scale.dim() == 1:
            scale_kind, valid = _SCALE_CHANNEL, tuple(weight_scale.shape) == (N,)
        else:
            scale_rows = scale_rows_per_block(weight, weight_scale)  # 128 x 128 (128) or row blocks (1)
            scale_kind, valid = _SCALE_BLOCK, scale_rows is not None
        if not valid:
            k_blocks = triton.cdiv(K, SCALE_BLOCK)
            raise ValueError(
                f"weight_scale must be {(N,)}, {(triton.cdiv(N, SCALE_BLOCK), k_blocks)} (128 x 128 blocks)"
                f" or {(N, k_blocks)} (row blocks), got {tuple(weight_scale.shape)}"
            )
        weight_scale = weight_scale.float()  # no copy for the usual fp32 scales
        if weight_scale.stride(-1) != 1:
            weight_scale = weight_scale.contiguous()
        stride_sn = weight_scale.stride(0) if scale_kind == _SCALE_BLOCK else 0
    cfg = config or _config(M, N, K, weight.dtype, device_sms(x.device), 2 if glu else 1)
    # 16-byte weight vectors, at most two 16-byte x loads per vector (fp32 x with FP8: 8-byte weight vectors)
    vec_x = 16 // x.element_size()
    vec = min(16 // weight.element_size(), 2 * vec_x)
    # Block scales need each tensor-core slice inside one 128-wide K block.
    k_sub = min(cfg.block_k, SCALE_BLOCK) if scale_kind == _SCALE_BLOCK else cfg.block_k
    if cfg.block_k % vec or (cfg.use_dot and (cfg.block_n < 16 or k_sub < 16)):
        raise ValueError(f"invalid config {cfg}")
    split_k = max(1, min(cfg.split_k, triton.cdiv(K, cfg.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(K, k_per_split)  # no empty splits
    if glu and (split_k > 1 or cfg.block_n % 2 or cfg.use_dot):
        # The epilogue needs whole sums and row pairs: two launches instead. Tensor-core
        # launches too: there it cost 7 % at batch 8 (27B FP8 decode, H200).
        return silu_and_mul(_gemv(x, weight, weight_scale, bias, cfg, glu=False))
    if conv is not None and split_k > 1:
        # Whole sums only after the split sum: the conv kernel on the plain product instead.
        return conv_first_columns(_gemv(x, weight, weight_scale, bias, cfg, glu=False), *conv)
    even_k = K % k_per_split == 0
    block_m = _block_m(M, cfg.use_dot, fp8)
    use_pdl = pdl_enabled(x)
    target = out if split_k == 1 else torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
    dummy = out  # never read: the constexpr flags compile those loads away
    conv_weight, conv_state, state_slots = conv or (dummy, dummy, dummy)
    conv_width = conv_weight.shape[-1] if conv is not None else 0
    _gemv_kernel[(triton.cdiv(N // 2 if glu else N, cfg.block_n // 2 if glu else cfg.block_n), split_k)](
        x,
        weight,
        dummy if weight_scale is None else weight_scale,
        dummy if bias is None else bias,
        target,
        conv_weight,
        conv_state,
        state_slots,
        M,
        N,
        K,
        x.stride(0),
        out.stride(0),
        stride_sn,
        conv_weight.stride(0),
        conv_state.stride(0),
        conv_state.stride(1) if conv is not None else 0,
        conv_weight.shape[0] if conv is not None else 0,
        k_per_split,
        SCALE=scale_kind,
        SCALE_ROWS=scale_rows,
        HAS_BIAS=bias is not None,
        SPLIT=split_k > 1,
        USE_DOT=cfg.use_dot,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        VEC=vec,
        SPLIT_X=vec // vec_x if vec > vec_x else 1,
        K_SUB=k_sub,
        EVEN_K=even_k,
        EVEN_M=M == block_m,
        FP8_ASM=x.is_cuda,  # inline PTX: not for the CPU interpreter
        PREFETCH=cfg.prefetch and not cfg.use_dot,
        GLU=glu,
        CONV_K=conv_width,
        STATE_COLS=triton.next_power_of_2(max(1, conv_width - 1)),
        USE_PDL=use_pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=use_pdl,  # the interpreter's launcher drops launch options it does not know
    )
    if split_k > 1:
        sum_splits(target, bias, out, use_pdl)
    return out
