"""NVFP4 GEMM out[M, N] = x[M, K] @ W[N, K]^T on the tensor cores, for prefill (any M).

Layout and exact semantics: nvfp4_gemv/ref.py. Hopper has no FP4 tensor cores. Two routes:
- below DEQUANTIZED_MIN_ROWS rows (the kernel below), each program dequantizes its weight
  tiles in registers and feeds them to bf16 (or fp16) tl.dot; no dequantized copy of the
  weight is written. Its K loop decodes every weight element once per BLOCK_M rows, which
  bounds it under the dense rate (measured 0.26-0.41x bf16 cuBLAS on an H100).
- from DEQUANTIZED_MIN_ROWS rows, dequantize_nvfp4 writes the weight in x's dtype (each value
  the reference's fp32 one, rounded once: block scale x row scale do not fit 16 bits) and
  cuBLAS multiplies: ~4.6 bytes moved per weight (codes and scales read, the copy written and
  read back) against 2 * M FLOP. The copy runs at the copy bandwidth (H100: 183 us for the
  27B's gate|up, 98 us for its down, 8 x 1024 tiles), so the route wins from 512 rows (gate|up
  0.42 ms against the in-register kernel's 0.67 ms; down 0.23 against 0.72) and reaches
  0.88-0.93x bf16 at 8,192 rows against the in-register kernel's 0.40x (docs/kernels.md).

Exactness: an e2m1 value has at most 2 significant bits (0.5 ... 6) and an e4m3 scale at
most 4 (subnormals fewer), so value * block scale has at most 6 and lies in [2^-10, 2688]
or is 0: exact in bf16 (8 bits) and in fp16 (11 bits, normal from 2^-14, max 65504). The
tile is built in fp32 ((value * 2^-14 from the GEMV's fp16 bit decode) times (scale * 2^14),
both exact) and converted without rounding. The tensor cores' products of two 16-bit
values are exact in fp32; the sums are fp32. The fp32 row scale multiplies each output
column's total once at the end, then the bias. The reference rounds block_scale * row_scale
in fp32 before the product, so the two differ by fp32 rounding order only.

Orientation: acc[BLOCK_N, BLOCK_M] += W_tile @ x_tile^T. The weight tile is the MMA's A
operand, which Hopper's wgmma takes from registers: the sm_90 build (Triton 3.8, compiled on
a CPU machine) loads the packed bytes from shared memory straight into the operand layout
(each byte is a thread's pair of consecutive K elements), decodes there and issues
wgmma with A in registers and x^T from shared memory, with cp.async pipelining of the code
bytes, block scales and x. The other orientation (x as A, the decoded weight stored to
shared memory as B) took as many instructions plus a store and barrier per step.

Untuned: no GPU was available. The tile table in `_config` comes from the sm_90 build
(registers, spills, shared memory, instructions in the K loop read with cuobjdump), not from
a measurement. Expected bound: the loop issues ~9 thread-instructions per weight element
(571 per thread and 128-wide step of a 128-row weight tile on 8 warps: byte loads, nibble
moves, fp16 -> fp32, scale multiply, bf16 pack) per program, so once per BLOCK_M rows. The
H200's bf16 tensor cores do ~3,800 FLOP per SM per clock against 128 issued
thread-instructions, so the 2 * BLOCK_M FLOP of a weight element leave ~0.068 * BLOCK_M
instructions: 8.7 at BLOCK_M = 128 (decoding takes as long as the MMAs), 17 at 256 (half as
long; wgmma runs asynchronously with the next tile's decode). So large M takes 256-row
tiles, and the kernel should land between ~50 % and the dense bf16 GEMM's rate, to be
measured.

fp32 x: declined to the reference (dequantize, then one fp32 matmul): keeping fp32 products
exact would need fp32 FMA dots (no tf32), slower than cuBLAS on the dequantized weight, and
serving runs bf16. Launch shapes come from shapes only (cached) and the output is
torch.empty: capture-safe for CUDA graphs. PDL where allowed (batches above MAX_ROWS decode
through this kernel too): the wait comes first, as Triton's pipeline prologue issues the
weight and x loads together.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ninfer.kernels.backend import fast_version
from ninfer.kernels.nvfp4_gemm import ref
from ninfer.kernels.nvfp4_gemv.ref import BLOCK, kernel_operands
from ninfer.kernels.nvfp4_gemv.triton import _decode, _weight_tile, ptx_decode
from ninfer.kernels.pdl import pdl_enabled, pdl_sync
from ninfer.kernels.sm_count import device_sms

# From this many rows of x the product runs on cuBLAS over a dequantized copy of the weight: at
# 512 rows the copy and cuBLAS already take 0.32-0.63x the in-register kernel's time (H100,
# docs/kernels.md); below, the copy's fixed cost outweighs the kernel's decode.
DEQUANTIZED_MIN_ROWS = 512
# dequantize_nvfp4's tile (weight rows, values per row): the fastest measured, at the copy
# bandwidth on both 27B shapes (16 x 256: 81-88%; 32 x 256: 62-69%).
DEQUANTIZE_BLOCK_N, DEQUANTIZE_BLOCK_K = 8, 1024



class Config(NamedTuple):
    """One launch shape. block_m: x rows per program (the MMA's N: 16 ... 256); block_n:
    weight rows per program (the MMA's M: 64 per warpgroup); block_k: K elements per step,
    a multiple of 16 (whole scale blocks); group_m: row tiles that consecutive programs
    walk before the next weight tile (x tiles shared in L2)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 8
    num_stages: int = 2
    group_m: int = 8


@triton.jit
def _nvfp4_gemm_kernel(
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
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    DECODE_BY_ASM: tl.constexpr,
):
    pdl_sync(USE_PDL)  # x comes from the previous kernel; the pipeline prologue loads x with W
    GROUPS: tl.constexpr = BLOCK_K // 16  # scale blocks per row and step
    GROUP_BYTES: tl.constexpr = 8  # code bytes under one block scale
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # Programs in flight share x row tiles (BLOCK_M * 2 bytes per K, against BLOCK_N * 9/16
    # for the weight): runs of GROUP_M row tiles, row tile fastest.
    band = pid // (GROUP_M * tiles_n)
    first_m = band * GROUP_M
    band_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % band_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // band_rows
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Clamped rows re-read the last real one, so loads need no row masks; the store is masked.
    m_load = tl.minimum(m, M - 1).to(tl.int64)
    n_load = tl.minimum(n, N - 1).to(tl.int64)
    g = tl.arange(0, GROUPS)
    byte = g[None, :, None] * GROUP_BYTES + tl.arange(0, GROUP_BYTES)[None, None, :]
    w_ptrs = w_ptr + n_load[:, None, None] * stride_wn + byte
    s_ptrs = block_scale_ptr + n_load[:, None] * stride_sn + g[None, :]
    kk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + m_load[:, None] * stride_xm + kk[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            packed = tl.load(w_ptrs + k0 // 2)
            scale = tl.load(s_ptrs + k0 // 16)
            xt = tl.load(x_ptrs + k0)
        else:
            # K is a multiple of 16: scale blocks are whole, in or out. Zero codes and zero
            # scales past K, and zero x: no NaN from memory that is not the operands'.
            in_k = (k0 + g * 16) < K
            packed = tl.load(w_ptrs + k0 // 2, mask=in_k[None, :, None], other=0)
            scale = tl.load(s_ptrs + k0 // 16, mask=in_k[None, :], other=0.0)
            xt = tl.load(x_ptrs + k0, mask=((k0 + kk) < K)[None, :], other=0.0)
        w = _weight_tile(packed, scale, x_ptr.dtype.element_ty, DECODE_BY_ASM)
        acc = tl.dot(w, tl.trans(xt), acc)
    out = acc * tl.load(row_scale_ptr + n_load)[:, None]
    if HAS_BIAS:
        out += tl.load(bias_ptr + n_load).to(tl.float32)[:, None]
    # Transposed back for the store: out rows are contiguous along n.
    out = tl.trans(out).to(out_ptr.dtype.element_ty)
    mask = (m[:, None] < M) & (n[None, :] < N)
    tl.store(out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :], out, mask=mask)


@functools.cache
def _config(M: int, N: int, K: int, num_sms: int) -> Config:
    """Default launch shape, untuned (no GPU measurement yet): from the sm_90 build
    (Triton 3.8, 16-byte aligned operands; registers, spills and shared memory read with
    cuobjdump) and the issue arithmetic of the module docstring.

    - block_n 128 on 8 warps (two warpgroups of 64 weight rows, so each weight is decoded
      once), block_k 128: each thread then loads 4 bytes of block scales per step, which
      Triton pipelines with cp.async with the codes and x (at block_k 64, 2 bytes, it loaded
      them synchronously every step). That needs the scale rows 16-byte aligned, which the
      JIT can only know for K a multiple of 256 (the 27B and 35B-A3B shapes are); other K
      take block_k 64, where the loads are synchronous and nothing spills.
    - block_m 256 from M = 512 where the grid keeps >= 2 programs per SM: the decode per
      weight element is paid once per 256 rows, about half the tensor-core time (249-254
      registers, no spills, 2 stages in 137 KiB of shared memory; 3 stages would take 210
      KiB). Else 128 (170 registers, 3 stages, 114 KiB): below 512 rows a 256-row tile pads
      up to twice the rows. M = 1024 x N = 5120 thus takes 128 rows (320 programs, where 256
      would leave 160: 1.2 waves); at M = 8192 every 27B shape takes 256 (1,280 to 8,704
      programs).
    - M <= 64 (decode batches above MAX_ROWS, short prefills): one row tile of 16-64 rows (the
      MMA's N) and block_n 64 on 4 warps, twice the programs of 128-row weight tiles (80-128
      registers, 4 stages, 30-78 KiB).
    """
    block_k = 128 if K % 256 == 0 else 64
    if M <= 64:
        return Config(max(16, triton.next_power_of_2(M)), 64, block_k, num_warps=4, num_stages=4)
    if block_k == 128 and M >= 512 and triton.cdiv(M, 256) * triton.cdiv(N, 128) >= 2 * num_sms:
        return Config(256, 128, block_k, num_warps=8, num_stages=2)
    return Config(128, 128, block_k, num_warps=8, num_stages=3)




@triton.jit
def _dequantize_kernel(
    w_ptr,
    block_scale_ptr,
    row_scale_ptr,
    out_ptr,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    VALUE: tl.constexpr,
):
    """Program (matrix, row tile, byte tile): each code byte becomes one word of the output
    (out_ptr: its words, 32-bit for 16-bit values, 64-bit for fp32) holding its two values, the
    low nibble's at the lower address, so the load and the store are plain tiles along the
    rows. Each value times (block scale times row scale), the scales' product rounded first in
    fp32 as nvfp4_gemv/ref.py's dequantization does. VALUE: 0 bf16, 1 fp16, 2 fp32."""
    matrix = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    byte = tl.program_id(2) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    rows = matrix * N + n.to(tl.int64)
    mask = (n < N)[:, None] & (byte < K // 2)[None, :]
    offsets = rows[:, None] * (K // 2) + byte[None, :]
    packed = tl.load(w_ptr + offsets, mask=mask, other=0)
    # 8 bytes (16 codes) a block scale: the 8 loads of one hit the same address.
    block_scale = tl.load(block_scale_ptr + rows[:, None] * (K // 16) + (byte // 8)[None, :], mask=mask, other=0.0)
    scale = block_scale.to(tl.float32) * tl.load(row_scale_ptr + rows, mask=n < N, other=0.0)[:, None]
    low, high = _decode(packed)  # values times 2^-14, exact
    low = low * 16384.0 * scale
    high = high * 16384.0 * scale
    if VALUE == 2:
        word = low.to(tl.uint32, bitcast=True).to(tl.int64) | (high.to(tl.uint32, bitcast=True).to(tl.int64) << 32)
    else:
        value = tl.bfloat16 if VALUE == 0 else tl.float16
        low_bits = low.to(value).to(tl.uint16, bitcast=True).to(tl.int32)
        word = low_bits | (high.to(value).to(tl.uint16, bitcast=True).to(tl.int32) << 16)
    tl.store(out_ptr + offsets, word, mask=mask)


# The output word of one code byte (two values) by value dtype, and the kernel's VALUE code.
_WORDS = {torch.bfloat16: (torch.int32, 0), torch.float16: (torch.int32, 1), torch.float32: (torch.int64, 2)}


def dequantize_nvfp4(
    weight, block_scale, row_scale, dtype: torch.dtype, *, block_n: int = DEQUANTIZE_BLOCK_N, block_k: int | None = None
):
    """The weight [N, K/2] (or E such matrices [E, N, K/2], contiguous, scales with contiguous
    rows) dequantized to dtype (bf16, fp16 or fp32): nvfp4_gemv/ref.py's fp32 values, each
    rounded once. block_k: values a program writes per row (a power of two >= 2; by default
    DEQUANTIZE_BLOCK_K, or K rounded up to a power of two where shorter). Runs on the device
    with no host sync (capturable)."""
    if block_k is None:
        block_k = min(DEQUANTIZE_BLOCK_K, max(2, triton.next_power_of_2(weight.shape[-1] * 2)))
    if block_k < 2 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 2, not {block_k}")
    if dtype not in _WORDS:
        raise ValueError(f"dequantize_nvfp4 writes bf16, fp16 or fp32, not {dtype}")
    word, value = _WORDS[dtype]
    *matrices, rows, packed_cols = weight.shape
    out = torch.empty((*matrices, rows, packed_cols * 2), dtype=dtype, device=weight.device)
    num_matrices = weight.numel() // max(1, rows * packed_cols)
    grid = (num_matrices, triton.cdiv(rows, block_n), triton.cdiv(packed_cols, block_k // 2))
    _dequantize_kernel[grid](
        weight, block_scale, row_scale, out.view(word), rows, packed_cols * 2,
        BLOCK_N=block_n, BLOCK_BYTES=block_k // 2, VALUE=value, num_warps=4,
    )  # fmt: skip
    return out


@fast_version(ref.nvfp4_matmul)
def nvfp4_matmul(x, weight, block_scale, row_scale, bias=None, *, config: Config | None = None):
    """Config overrides the heuristic (tests, benchmarks).
    x bf16 or fp16 (fp32 runs the reference); K must be a multiple of 16 (the block size)."""
    M, K = x.shape
    N = weight.shape[0]
    if x.dtype not in (torch.bfloat16, torch.float16) or K == 0:
        # fp32: see the module docstring. K = 0: no step to run.
        return ref.nvfp4_matmul(x, weight, block_scale, row_scale, bias)
    x, row_scale, bias = kernel_operands("GEMM", x, weight, block_scale, row_scale, bias)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if config is None and M >= DEQUANTIZED_MIN_ROWS and weight.is_contiguous() and block_scale.is_contiguous():
        # Many rows: the decode in the K loop would bound the tensor cores; one dequantized copy
        # of the weight (a few % of the product's time) and cuBLAS instead.
        dense = dequantize_nvfp4(weight, block_scale, row_scale, x.dtype)
        return torch.nn.functional.linear(x, dense, None if bias is None else bias.to(x.dtype))
    cfg = config or _config(M, N, K, device_sms(x.device))
    if cfg.block_k % BLOCK or min(cfg.block_m, cfg.block_n, cfg.block_k) < 16 or cfg.group_m < 1:
        raise ValueError(f"invalid config {cfg}")
    use_pdl = pdl_enabled(x)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _nvfp4_gemm_kernel[grid](
        x,
        weight,
        block_scale,
        row_scale,
        out if bias is None else bias,  # never read without HAS_BIAS
        out,
        M,
        N,
        K,
        x.stride(0),
        weight.stride(0),
        block_scale.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        EVEN_K=K % cfg.block_k == 0,
        USE_PDL=use_pdl,
        DECODE_BY_ASM=ptx_decode(x),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=use_pdl,  # the interpreter's launcher drops launch options it does not know
    )
    return out
