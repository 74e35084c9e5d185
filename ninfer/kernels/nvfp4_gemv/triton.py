"""Weight-only NVFP4 GEMV out[M, N] = x[M, K] @ W[N, K]^T for decode batches (M <= 16).

Layout and exact semantics: ref.py (uint8 [N, K/2] e2m1 codes, low nibble first; e4m3 scale
per 16 codes of a row; fp32 scale per row). Two paths: FMA (below; one row, and fp16 x) and,
from DOT_MIN_ROWS rows of bf16 x, tensor cores (_nvfp4_dot_kernel: weight tiles widened by a
PTX table lookup, as the NVFP4 GEMM's). Measured on an H100 (docs/kernels.md): at 8 rows the
tensor-core path is 3.2-5.1x faster; at one row FMA is.

At M <= 16 the product is a weight stream (0.5 byte per weight, plus 1/16 byte of block
scale), so the goal is to read W once at HBM bandwidth. As gemv/triton.py's FMA path: each
program owns BLOCK_N whole output columns for all M rows and walks K in BLOCK_K steps, so
every output is one fixed-order fp32 sum (no atomics, the same bits every run). A thread
reads one vector of VEC_BYTES bytes (2 * VEC_BYTES codes, inside one 16-code scale block)
of each of its program's weight rows per step, and the matching x values of every row as
16-byte loads (X_PIECES of them); the few x rows stay in L1/L2.

Decoding a code in registers, exactly: the code's sign bit goes to fp16's sign bit and its
3 magnitude bits (2 exponent, 1 mantissa) to the bottom of fp16's exponent field and the
top of its mantissa, giving the e2m1 value times 2^-14 (code 1, 0.5, becomes fp16's
subnormal 2^-15), then fp16 -> fp32. Per byte, with b sign-extended to 32 bits:
low nibble ((b << 28) >> 19) & 0x8E00, high nibble (b << 5) & 0x8E00. The products of
each vector with x are summed in registers, that sum is multiplied by the vector's block
scale (M multiplies per vector, not one per code), and the 2^14 goes into the row scale
that multiplies each column's total at the end.

Cost (sm_90 build, bf16 x): the K loop issues 13.6 / 17 / 26 / 43 / 90 instructions per
weight byte at M = 1 / 2 / 4 / 8 / 16 (decode ~8 per byte, then about 3 per byte and row of x),
against ~7.8 per byte that an SM may issue at full bandwidth. At one row that is not what
binds: a fifth fewer instructions (a table-lookup decode) changed nothing measured, while 4
weight rows per program instead of 8 (72 registers instead of 157, more programs per SM)
ran 13-25% faster (H100, 27B shapes: 47% of copy bandwidth on 16480 x 5120). More rows
are issue-bound, hence the tensor-core path from 2 rows of bf16 x.

The FMA path never splits K: the 27B shapes give >= 640 programs at its default tiles; the
tensor-core path's 32-row tiles give 160 on N = 5120, so there K is split (fp32 partials).
Launch shapes come from shapes only (cached) and the output is torch.empty, so the launch is
capture-safe for CUDA graphs. PDL (ninfer.kernels.pdl) where allowed: the first weight tile is loaded
before the wait (the weight is read-only for the launch chain), x after it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ninfer.kernels.backend import fast_version
from ninfer.kernels.gemv.triton import sum_splits
from ninfer.kernels.nvfp4_gemv import ref
from ninfer.kernels.nvfp4_gemv.ref import MAX_ROWS, kernel_operands
from ninfer.kernels.pdl import pdl_enabled, pdl_sync
from ninfer.kernels.sm_count import device_sms



class Config(NamedTuple):
    """One launch shape. block_n: weight rows per program; block_k: codes per row and step;
    vec_bytes: bytes of a row one thread reads per step (2 * vec_bytes codes, dividing 16
    so that a vector never straddles a scale block). use_dot: the tensor-core path (bf16 x;
    vec_bytes unused, num_stages its pipeline depth, split_k programs along K). double_buffer
    (FMA): each step's weight codes, block scales and x are loaded before the step before it is
    computed, so a thread's next loads are in flight while it computes."""

    block_n: int
    block_k: int
    vec_bytes: int = 8
    num_warps: int = 2
    use_dot: bool = False
    num_stages: int = 1
    split_k: int = 1
    double_buffer: bool = False


DOT_ROWS = 8  # x^T is the MMA's B operand: 8 columns per MMA, so x is padded to 8 rows at least


@triton.jit
def _fp16_bits_to_fp32(bits):
    """int32 holding an fp16 bit pattern in its low 16 bits -> that value in fp32 (exact)."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode(packed):
    """uint8 bytes -> (low-nibble, high-nibble) e2m1 values times 2^-14, fp32.

    Sign-extending the byte puts copies of bit 7 above it, so after the shift bit 15 of the
    high code's pattern is its sign; the low code is first moved to the top of the word so
    that its sign bit gets the same copies (arithmetic shift back down).
    """
    b = packed.to(tl.int8, bitcast=True).to(tl.int32)
    low = ((b << 28) >> 19) & 0x8E00
    high = (b << 5) & 0x8E00
    return _fp16_bits_to_fp32(low), _fp16_bits_to_fp32(high)


# Weight tiles by table lookup (prmt) for the tensor-core paths (this GEMV's DOT path, the NVFP4
# GEMM), 4 code bytes (8 codes) a call: $0, $1 the low codes of bytes 0-1 and 2-3 (bf16 pairs)
# times their block scales $5, $6 (bf16 pairs), $2, $3 the high codes; $4 the bytes. The e2m1
# magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 in bf16 are 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000,
# 0x4040, 0x4080, 0x40C0: their low bytes (0xC0800000, 0xC0804000) and high bytes (0x3F3F3F00,
# 0x40404040) are 8-entry tables, each code's 3 magnitude bits its selector. With the bytes
# shifted left by 4 beside them, every code's sign (bit 3 of its nibble) is the top bit of some
# byte: a prmt gathers those of 4 codes and one lop3 (0xF8: a | (b & c)) ORs them into their high
# bytes. A prmt pairs low and high bytes into bf16 values; fma with -0 added keeps -0 and, value
# and scale having 2 + 4 significant bits, is exact. Tests run these instructions on every byte
# in Python (the interpreter cannot run PTX). The FMA path keeps _decode: these pairs widened to
# fp32 inside the asm (a fifth fewer instructions in its loop) measured no faster (H100, one row,
# 27B shapes): that loop is bound by its loads' latency, not by issue.
DECODE_BF16_ASM_LINES = (
    "and.b32 m, $4, 0x77777777;",
    "shr.b32 n, m, 16;",
    "prmt.b32 l01, 0xC0800000, 0xC0804000, m;",
    "prmt.b32 h01, 0x3F3F3F00, 0x40404040, m;",
    "prmt.b32 l23, 0xC0800000, 0xC0804000, n;",
    "prmt.b32 h23, 0x3F3F3F00, 0x40404040, n;",
    "shl.b32 w4, $4, 4;",
    "prmt.b32 sg, w4, $4, 0x5140;",
    "lop3.b32 h01, h01, sg, 0x80808080, 0xF8;",
    "prmt.b32 sg, w4, $4, 0x7362;",
    "lop3.b32 h23, h23, sg, 0x80808080, 0xF8;",
    "mov.b32 z, 0x80008000;",
    "prmt.b32 v, l01, h01, 0x6240;",
    "fma.rn.bf16x2 $0, v, $5, z;",
    "prmt.b32 v, l23, h23, 0x6240;",
    "fma.rn.bf16x2 $1, v, $6, z;",
    "prmt.b32 v, l01, h01, 0x7351;",
    "fma.rn.bf16x2 $2, v, $5, z;",
    "prmt.b32 v, l23, h23, 0x7351;",
    "fma.rn.bf16x2 $3, v, $6, z;",
)
DECODE_BF16_ASM = tl.constexpr("{\n.reg .b32 m, n, l01, h01, l23, h23, w4, sg, z, v;\n" + "\n".join(DECODE_BF16_ASM_LINES) + "\n}")
PTX_DECODE = True


def ptx_decode(x: torch.Tensor) -> bool:
    """Whether tensor-core launches for x decode codes by the PTX lookup: on CUDA unless
    PTX_DECODE is off (benchmarks time the fp16 decode beside it); the CPU interpreter
    cannot run inline PTX."""
    return x.is_cuda and PTX_DECODE


@triton.jit
def _weight_tile(packed, scale, DTYPE: tl.constexpr, ASM: tl.constexpr = False):
    """Code bytes [BLOCK_N, G, 8] and their e4m3 block scales [BLOCK_N, G] -> the weight
    tile [BLOCK_N, 16 G] as value * block scale in DTYPE (exact: value * block scale has at
    most 6 significant bits and lies in [2^-10, 2688], normal in bf16 and fp16). ASM (bf16,
    sm_90 builds): by table lookup (DECODE_BF16_ASM, 20 instructions for 8 codes)."""
    BLOCK_N: tl.constexpr = packed.shape[0]
    GROUPS: tl.constexpr = packed.shape[1]
    if ASM and DTYPE == tl.bfloat16:
        s = tl.broadcast_to(scale.to(tl.float32).to(tl.bfloat16)[:, :, None], packed.shape)
        low, high = tl.inline_asm_elementwise(
            DECODE_BF16_ASM, "=r,=r,=r,=r,r,r,r", [packed, s], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )
        return tl.reshape(tl.join(low, high), [BLOCK_N, GROUPS * 16])
    low, high = _decode(packed)  # value * 2^-14, fp32
    s = (scale.to(tl.float32) * 16384.0)[:, :, None]
    # Byte j holds elements 2j (low nibble) and 2j + 1 (high): interleave them back.
    return tl.reshape(tl.join(low * s, high * s), [BLOCK_N, GROUPS * 16]).to(DTYPE)


@triton.jit
def _load_tile(w_ptrs, k0, r, K, VEC: tl.constexpr, EVEN_K: tl.constexpr):
    """The [BLOCK_N, 1, R, VEC_BYTES] packed weight tile of step k0 (zero codes past K)."""
    if EVEN_K:
        return tl.load(w_ptrs + k0 // 2)
    valid = (k0 + r * VEC) < K
    return tl.load(w_ptrs + k0 // 2, mask=valid[None, None, :, None], other=0)


@triton.jit
def _load_x_and_scales(x_ptrs, s_ptrs, k0, r, K, VEC: tl.constexpr, EVEN_K: tl.constexpr):
    """Step k0's x pieces [1, BLOCK_M, X_PIECES, R, PIECE] and block scales [BLOCK_N, 1, R]."""
    if EVEN_K:
        return tl.load(x_ptrs + k0), tl.load(s_ptrs + k0 // 16)
    # K is a multiple of 16 and a vector lies inside one 16-code block: whole vectors are in or out.
    valid = (k0 + r * VEC) < K
    xt = tl.load(x_ptrs + k0, mask=valid[None, None, None, :, None], other=0.0)
    return xt, tl.load(s_ptrs + k0 // 16, mask=valid[None, None, :], other=0.0)


@triton.jit
def _step(packed, x_ptrs, s_ptrs, k0, r, K, X_PIECES: tl.constexpr, EVEN_K: tl.constexpr):
    """One K step: the loaded tile times x -> [BLOCK_N, BLOCK_M, R] block-scaled vector sums."""
    VEC: tl.constexpr = 2 * packed.shape[3]
    xt, s = _load_x_and_scales(x_ptrs, s_ptrs, k0, r, K, VEC, EVEN_K)
    return _step_loaded(packed, xt, s, X_PIECES)


@triton.jit
def _step_loaded(packed, xt, s, X_PIECES: tl.constexpr):
    """_step with its x pieces and block scales loaded."""
    BLOCK_N: tl.constexpr = packed.shape[0]
    R: tl.constexpr = packed.shape[2]
    VEC_BYTES: tl.constexpr = packed.shape[3]
    BLOCK_M: tl.constexpr = xt.shape[1]
    PIECE: tl.constexpr = 2 * VEC_BYTES // X_PIECES  # x elements of one 16-byte load
    # A thread's vector as X_PIECES pieces, each meeting one x load: (n, 1, piece, r, byte).
    packed = tl.permute(tl.reshape(packed, [BLOCK_N, 1, R, X_PIECES, PIECE // 2]), [0, 1, 3, 2, 4])
    low, high = _decode(packed)
    # x's even elements meet the low nibbles, odd ones the high: a split in registers.
    x_even, x_odd = tl.split(tl.reshape(xt.to(tl.float32), [1, BLOCK_M, X_PIECES, R, PIECE // 2, 2]))
    part = tl.sum(tl.sum(x_even * low + x_odd * high, axis=4), axis=2)
    return part * s.to(tl.float32)


@triton.jit
def _nvfp4_gemv_kernel(
    x_ptr,
    w_ptr,
    block_scale_ptr,
    row_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC_BYTES: tl.constexpr,
    X_PIECES: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    DOUBLE_BUFFER: tl.constexpr = False,
):
    VEC: tl.constexpr = 2 * VEC_BYTES  # codes per vector
    PIECE: tl.constexpr = VEC // X_PIECES
    R: tl.constexpr = BLOCK_K // VEC  # vectors of a row per step
    FOLD: tl.constexpr = 16384.0  # 2^14: the decoded codes are their values times 2^-14
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Clamped indices: rows past M or N re-read the last real one, so loads need no row masks;
    # only the store is masked.
    m_load = tl.minimum(m, M - 1)
    n_load = tl.minimum(n, N - 1).to(tl.int64)
    r = tl.arange(0, R)
    # Tiles over (column n, row m, [x piece], vector r, element): Triton gives a load's threads
    # to the dimensions next to its contiguous one first, so r comes last but one: threads
    # spread along K alike for the weight and x, and each thread keeps its vector.
    byte = r[None, None, :, None] * VEC_BYTES + tl.arange(0, VEC_BYTES)[None, None, None, :]
    w_ptrs = w_ptr + n_load[:, None, None, None] * stride_wn + byte
    piece = tl.arange(0, X_PIECES)[None, None, :, None, None] * PIECE
    code = r[None, None, None, :, None] * VEC + piece + tl.arange(0, PIECE)[None, None, None, None, :]
    x_ptrs = x_ptr + m_load[None, :, None, None, None] * stride_xm + code
    s_ptrs = block_scale_ptr + n_load[:, None, None] * stride_sn + (r * VEC // 16)[None, None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M, R], dtype=tl.float32)
    first = _load_tile(w_ptrs, 0, r, K, VEC, EVEN_K)
    pdl_sync(USE_PDL)  # x comes from the previous kernel
    if DOUBLE_BUFFER:
        # Step k0's loads go out before step k0 - BLOCK_K is computed: the loop carries them.
        packed = first
        xt, s = _load_x_and_scales(x_ptrs, s_ptrs, 0, r, K, VEC, EVEN_K)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            next_packed = _load_tile(w_ptrs, k0, r, K, VEC, EVEN_K)
            next_xt, next_s = _load_x_and_scales(x_ptrs, s_ptrs, k0, r, K, VEC, EVEN_K)
            acc += _step_loaded(packed, xt, s, X_PIECES)
            packed, xt, s = next_packed, next_xt, next_s
        acc += _step_loaded(packed, xt, s, X_PIECES)
    else:
        acc += _step(first, x_ptrs, s_ptrs, 0, r, K, X_PIECES, EVEN_K)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            packed = _load_tile(w_ptrs, k0, r, K, VEC, EVEN_K)
            acc += _step(packed, x_ptrs, s_ptrs, k0, r, K, X_PIECES, EVEN_K)
    out = tl.sum(acc, axis=2) * (tl.load(row_scale_ptr + n_load) * FOLD)[:, None]
    if HAS_BIAS:
        out += tl.load(bias_ptr + n_load).to(tl.float32)[:, None]
    mask = (n[:, None] < N) & (m[None, :] < M)
    tl.store(out_ptr + m[None, :] * stride_om + n[:, None], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nvfp4_dot_kernel(
    x_ptr,
    w_ptr,
    block_scale_ptr,
    row_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr,
    DECODE_BY_ASM: tl.constexpr,
):
    """acc[BLOCK_N, BLOCK_M] += W_tile @ x_tile^T on the tensor cores: each step's weight tile is
    code value x block scale in x's dtype (exact, as the NVFP4 GEMM builds it), the MMA's A
    operand (16 weight rows per warp), and x^T the B operand; the row scale multiplies each
    column's total once. bf16 x is the served case; fp32 x (exact products) is what Triton's
    CPU interpreter runs. K must be a multiple of BLOCK_K (the launch picks one that divides it).
    SPLIT: program (., s) sums K[s * k_per_split, ...) into fp32 partials [SPLIT_K, M, N] (row
    scale applied, no bias) that gemv's split sum adds in order."""
    GROUPS: tl.constexpr = BLOCK_K // 16  # scale blocks per row and step
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_load = tl.minimum(m, M - 1)  # rows past M re-read the last real one; only the store is masked
    n_load = tl.minimum(n, N - 1).to(tl.int64)
    g = tl.arange(0, GROUPS)
    byte = g[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    w_ptrs = w_ptr + n_load[:, None, None] * stride_wn + byte  # [BLOCK_N, GROUPS, 8]
    s_ptrs = block_scale_ptr + n_load[:, None] * stride_sn + g[None, :]  # [BLOCK_N, GROUPS]
    x_ptrs = x_ptr + m_load[None, :] * stride_xm + tl.arange(0, BLOCK_K)[:, None]  # x^T [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = tl.program_id(1) * k_per_split
    pdl_sync(USE_PDL)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        w = _weight_tile(tl.load(w_ptrs + k0 // 2), tl.load(s_ptrs + k0 // 16), x_ptr.dtype.element_ty, DECODE_BY_ASM)
        acc = tl.dot(w, tl.load(x_ptrs + k0), acc, input_precision="ieee")
    out = acc * tl.load(row_scale_ptr + n_load)[:, None]
    mask = (n[:, None] < N) & (m[None, :] < M)
    if SPLIT:
        tl.store(out_ptr + (tl.program_id(1) * M + m[None, :]) * N + n[:, None], out, mask=mask)
    else:
        if HAS_BIAS:
            out += tl.load(bias_ptr + n_load).to(tl.float32)[:, None]
        tl.store(out_ptr + m[None, :] * stride_om + n[:, None], out.to(out_ptr.dtype.element_ty), mask=mask)


# The tensor-core path from 2 rows of bf16 x (H100, 27B shapes, PTX decode; docs/kernels.md):
# 16480 x 5120 at 8 rows 43.9 us against the FMA path's 219; one row 46.6 against 36.8.
DOT_MIN_ROWS = 2
DOT_TILE = Config(block_n=32, block_k=128, num_warps=2, use_dot=True, num_stages=4)
# The FMA path's loads double-buffered by default (Config.double_buffer): off, measured slower
# (27B NVFP4 decode at batch 1: 81.1 against 90.1 tok/s on an H100; docs/kernels.md).
FMA_DOUBLE_BUFFER = False
# K is split until the grid holds about this many programs per SM (H100, 8 rows: 5120 x 17408
# best at 8 splits, 1,280 programs; 16480 x 5120 at 2, 1,030 programs; docs/kernels.md).
DOT_TARGET_PROGRAMS_PER_SM = 10


@functools.cache
def _config(M: int, N: int, K: int, num_sms: int, dot: bool = False) -> Config:
    """Default launch shape. dot (bf16 x): the tensor-core path from DOT_MIN_ROWS rows, on
    DOT_TILE (the best or within 3% of it at 8 rows on 16480 x 5120 and 5120 x 17408), its
    K step halved until it divides K, K split where the columns give few programs. Else the
    FMA path, chosen by register and bytes-in-flight arithmetic for the 27B shapes (K = 5120,
    6144, 17408):

    - vec_bytes: 8 (16 codes, one scale block, an 8-byte load) up to M = 4; above, 4, as a
      thread holds 2 * vec_bytes x values per row of x (16 rows x 16 would take 256 registers).
    - block_k: one vector per thread and row on at most 4 warps, so 2048 codes (1 KiB of a
      row) with 16-code vectors, 1024 with 8-code ones, where it divides K, else halved
      (down to one warp); num_warps = block_k / (2 * vec_bytes * 32). With 16-code vectors
      K = 5120 and 17408 take 1024 codes on 2 warps, 6144 takes 2048 on 4.
    - block_n: 4 rows up to M = 8, 2 above: per thread 2 * vec_bytes * block_n decoded
      weights and block_m * block_n sums (M = 16 with 4 rows spilled 112 bytes). At M = 1 and
      2, 8 rows took 157 registers against 72 and ran 13-25% slower on every 27B shape
      (H100, docs/kernels.md): the loop waits on its loads, and fewer programs fit an SM.
    - then fewer rows per program while the grid is under 4 programs per SM (as gemv).
    """
    if dot and M >= DOT_MIN_ROWS:
        block_k = DOT_TILE.block_k
        while K % block_k:
            block_k //= 2  # K is a multiple of 16
        programs = triton.cdiv(N, DOT_TILE.block_n)
        # Few column tiles (N = 5120 on 132 SMs: 160) leave SMs idle: split K into fp32
        # partials while the grid stays within the target, keeping >= 4 steps per split.
        split_k = 1
        while 2 * programs * split_k <= DOT_TARGET_PROGRAMS_PER_SM * num_sms and K // (2 * split_k * block_k) >= 4:
            split_k *= 2
        return DOT_TILE._replace(block_k=block_k, split_k=split_k)
    vec_bytes = 8 if M <= 4 else 4
    vec = 2 * vec_bytes
    block_k = min(vec * 32 * 4, max(vec * 32, triton.next_power_of_2(K)))
    while K % block_k and block_k > vec * 32:
        block_k //= 2
    num_warps = block_k // (vec * 32)
    block_n = 4 if M <= 8 else 2
    while block_n > 1 and triton.cdiv(N, block_n) < 4 * num_sms:
        block_n //= 2
    return Config(block_n, block_k, vec_bytes, num_warps, double_buffer=FMA_DOUBLE_BUFFER)


@fast_version(ref.gemv_nvfp4)
def gemv_nvfp4(x, weight, block_scale, row_scale, bias=None, *, config: Config | None = None):
    """Config overrides the heuristic (tests, benchmarks).
    K must be a multiple of 16 (the block size); above MAX_ROWS rows the reference runs."""
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_ROWS or K == 0:
        # The weight stream costs M FMAs per code: beyond decode sizes, one dense product of
        # the dequantized weight (the reference) is the better route. (K = 0: no step to run.)
        return ref.gemv_nvfp4(x, weight, block_scale, row_scale, bias)
    x, row_scale, bias = kernel_operands("GEMV", x, weight, block_scale, row_scale, bias)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    cfg = config or _config(M, N, K, device_sms(x.device), dot=x.dtype == torch.bfloat16 and K % 16 == 0)
    use_pdl = pdl_enabled(x)
    # Both kernels' leading arguments; the bias pointer is never read without HAS_BIAS.
    operands = (x, weight, block_scale, row_scale, out if bias is None else bias, out, M, N, K,
                x.stride(0), weight.stride(0), block_scale.stride(0), out.stride(0), bias is not None)
    if cfg.use_dot:
        if x.dtype not in (torch.bfloat16, torch.float32) or cfg.block_k % 16 or K % cfg.block_k or cfg.block_n % 16:
            raise ValueError(f"invalid config {cfg} for x {x.dtype} and K = {K} (DOT: bf16 or fp32 x, K a multiple of block_k)")
        # Whole K steps per split, none empty.
        k_per_split = triton.cdiv(K // cfg.block_k, max(1, cfg.split_k)) * cfg.block_k
        split_k = triton.cdiv(K, k_per_split)
        if split_k > 1:
            partials = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
            operands = operands[:5] + (partials,) + operands[6:]
        _nvfp4_dot_kernel[(triton.cdiv(N, cfg.block_n), split_k)](
            *operands,
            k_per_split,
            BLOCK_M=max(DOT_ROWS, triton.next_power_of_2(M)),
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            SPLIT=split_k > 1,
            USE_PDL=use_pdl,
            DECODE_BY_ASM=ptx_decode(x),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            launch_pdl=use_pdl,
        )
        if split_k > 1:
            sum_splits(partials, bias, out, use_pdl)
        return out
    vec = 2 * cfg.vec_bytes
    if 16 % vec or cfg.block_k % vec or cfg.block_k % 16 or cfg.block_n < 1:
        raise ValueError(f"invalid config {cfg}")
    _nvfp4_gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        *operands,
        BLOCK_M=triton.next_power_of_2(M),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        VEC_BYTES=cfg.vec_bytes,
        X_PIECES=max(1, 2 * cfg.vec_bytes * x.element_size() // 16),  # x read as 16-byte loads
        EVEN_K=K % cfg.block_k == 0,
        USE_PDL=use_pdl,
        DOUBLE_BUFFER=cfg.double_buffer,
        num_warps=cfg.num_warps,
        num_stages=1,  # Triton pipelines none of these loads: double_buffer does it by hand
        launch_pdl=use_pdl,  # the interpreter's launcher drops launch options it does not know
    )
    return out
