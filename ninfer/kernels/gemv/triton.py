"""Skinny matmul out[M, N] = x[M, K] @ W[N, K]^T for decode batches (M <= 16), bf16 or FP8 weights.

At M <= 16 the product is a pure weight stream: 2 * M FLOP per weight element against
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
    whose conversion costs ~1.6 instructions per element on top).
  - DOT (larger M): x padded to 16 rows and tl.dot(x, W_tile^T) on the tensor cores
    (cp.async-pipelined tiles), so the cost per weight element no longer grows with M.

FP8 (weight-only): the e4m3 bytes are converted in registers, exactly: to fp32 through
fp16 for FMA, to bf16 by an inline-PTX bit move for DOT (4 values per 32-bit register;
the CPU interpreter uses Triton's cast instead). A per-channel scale multiplies each column
sum once at the end; a 128 x 128 block scale multiplies each partial sum that lies in one
128-wide K block (a VEC vector for FMA, a <= 128-wide tensor-core slice for DOT).

Small N: programs own fewer columns (down to one) before K is split; a split-K launch
writes fp32 partials [SPLIT_K, M, N] that a second kernel sums in split order (still
deterministic). Launch shapes come from shapes and dtypes only (cached), outputs are
torch.empty: capture-safe for CUDA graphs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 128  # rows and columns per block scale (Qwen FP8 checkpoints)
MAX_ROWS = 16
DOT_ROWS = 16  # tl.dot's smallest M: DOT programs pad x to 16 rows
_SCALE_NONE, _SCALE_CHANNEL, _SCALE_BLOCK = 0, 1, 2


class Config(NamedTuple):
    """One launch shape. block_k: K elements per loop step; split_k: programs along K."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    use_dot: bool = False
    split_k: int = 1


@triton.jit
def _e4m3_to_bf16(w):
    """e4m3 -> bf16 by bit moves, 4 values per 32-bit register (Triton's own cast goes
    through fp16 and fp32, ~9 instructions per value at these tiles).

    Each byte is moved to the top of a 16-bit half (prmt); its 4 exponent + 3 mantissa
    bits shifted right by 4 land in bf16's exponent/mantissa fields, the sign stays at
    bit 15. That is the value times 2^-120 (bias 7 vs 127), subnormals included, so one
    exact bf16x2 multiply by 2^120 finishes (an fma with -0.0: sm_80's instruction set).
    """
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 lo, hi, sl, sh, bias, nz;
        prmt.b32 lo, $2, 0, 0x1404;
        prmt.b32 hi, $2, 0, 0x3424;
        and.b32 sl, lo, 0x80008000;
        and.b32 sh, hi, 0x80008000;
        shr.b32 lo, lo, 4;
        shr.b32 hi, hi, 4;
        lop3.b32 lo, lo, 0x07F007F0, sl, 0xEA;
        lop3.b32 hi, hi, 0x07F007F0, sh, 0xEA;
        mov.b32 bias, 0x7B807B80;
        mov.b32 nz, 0x80008000;
        fma.rn.bf16x2 $0, lo, bias, nz;
        fma.rn.bf16x2 $1, hi, bias, nz;
        }""",
        constraints="=r,=r,r",
        args=[w.to(tl.uint8, bitcast=True)],
        dtype=tl.bfloat16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def _to_fp32(w):
    if w.dtype == tl.float8e4nv:
        # Through fp16 (exact for e4m3): packed cvt.rn.f16x2.e4m3x2 for each pair, then one
        # f16 -> f32 per element; the direct cast converts element by element.
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,
    SPLIT_X: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """-> fp32 [BLOCK_M, BLOCK_N]: sum over k in [k_start, k_end) of x[m, k] * w[n, k] (block-scaled)."""
    R: tl.constexpr = BLOCK_K // VEC
    r = tl.arange(0, R)
    v = tl.arange(0, VEC)
    # Tiles are 4-D over (vector r, row m, column n, element v): x [R, BLOCK_M, 1, VEC] and
    # W [R, 1, BLOCK_N, VEC], pointers built in that shape. Putting R first makes Triton
    # spread threads along R for both loads (one warp reads 32 consecutive 16-byte vectors
    # of a weight row), so x arrives already in the weight's layout (no shared-memory
    # conversion in the loop) and the VEC axis stays inside one thread.
    kk = (k_start + r[:, None, None, None] * VEC + v[None, None, None, :]).to(tl.int64)
    w_ptrs = w_ptr + n_load.to(tl.int64)[None, None, :, None] * K + kk
    # x is read as SPLIT_X pieces of VEC // SPLIT_X (16 bytes each when the weight is FP8
    # and x is bf16), so each x load keeps the weight's thread layout.
    VEC_X: tl.constexpr = VEC // SPLIT_X
    kx = (k_start + r[:, None, None, None] * VEC + tl.arange(0, VEC_X)[None, None, None, :]).to(tl.int64)
    x_ptrs = x_ptr + m_load[None, :, None, None] * stride_xm + kx
    # Per (vector, row, column) sums: the VEC products are summed in registers every step,
    # the R vectors of a column only once after the loop.
    acc = tl.zeros([R, BLOCK_M, BLOCK_N], dtype=tl.float32)
    last_kb = (K - 1) // 128
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=(k0 + r[:, None, None, None] * VEC + v[None, None, None, :]) < K, other=0.0)
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
            kb = tl.minimum((k0 + r * VEC) // 128, last_kb)
            s = tl.load(scale_ptr + (n_load // 128)[None, :] * stride_sn + kb[:, None])
            part = part * s[:, None, :]
        acc += part
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return tl.sum(acc, axis=0)


@triton.jit
def _dot_tile(
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_SUB: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP8_ASM: tl.constexpr,
):
    """DOT version of _fma_tile: tensor-core products of K_SUB-wide slices (K_SUB <= 128 with block scales)."""
    kk = tl.arange(0, K_SUB)
    w_ptrs = w_ptr + n_load.to(tl.int64)[:, None] * K + (k_start + kk)[None, :]
    x_ptrs = x_ptr + m_load[:, None] * stride_xm + (k_start + kk)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    last_kb = (K - 1) // 128
    for k0 in range(k_start, k_end, BLOCK_K):
        for j in tl.static_range(BLOCK_K // K_SUB):
            if EVEN_K:
                w = tl.load(w_ptrs + j * K_SUB)
                xt = tl.load(x_ptrs + j * K_SUB)
            else:
                k_mask = (k0 + j * K_SUB + kk) < K
                w = tl.load(w_ptrs + j * K_SUB, mask=k_mask[None, :], other=0.0)
                xt = tl.load(x_ptrs + j * K_SUB, mask=k_mask[None, :], other=0.0)
            # e4m3 -> bf16/fp16/fp32 is exact; fp32 x keeps full fp32 products (no tf32).
            if FP8_ASM and w.dtype == tl.float8e4nv and x_ptr.dtype.element_ty == tl.bfloat16:
                w = _e4m3_to_bf16(w)
            else:
                w = w.to(x_ptr.dtype.element_ty)
            if SCALE == 2:
                part = tl.dot(xt, tl.trans(w), input_precision="ieee")
                kb = tl.minimum((k0 + j * K_SUB) // 128, last_kb)
                acc += part * tl.load(scale_ptr + (n_load // 128) * stride_sn + kb)[None, :]
            else:
                acc = tl.dot(xt, tl.trans(w), acc, input_precision="ieee")
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_sn,
    k_per_split,
    SCALE: tl.constexpr,
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
    FP8_ASM: tl.constexpr,
):
    pid_k = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    # Clamped indices: rows past N (or M) re-read the last real one, so the loads need no
    # masks and keep their 16-byte vectors; only the store is masked.
    n_load = tl.minimum(n, N - 1)
    m_load = tl.minimum(m, M - 1)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if USE_DOT:
        acc = _dot_tile(
            x_ptr, w_ptr, scale_ptr, m_load, n_load, k_start, k_end, K, stride_xm, stride_sn,
            SCALE, BLOCK_M, BLOCK_N, BLOCK_K, K_SUB, EVEN_K, FP8_ASM,
        )  # fmt: skip
    else:
        acc = _fma_tile(
            x_ptr, w_ptr, scale_ptr, m_load, n_load, k_start, k_end, K, stride_xm, stride_sn,
            SCALE, BLOCK_M, BLOCK_N, BLOCK_K, VEC, SPLIT_X, EVEN_K,
        )  # fmt: skip
    if SCALE == 1:
        acc = acc * tl.load(scale_ptr + n_load)[None, :]
    mask = (m[:, None] < M) & (n[None, :] < N)
    if SPLIT:
        # fp32 partial of split pid_k; _split_sum_kernel adds the splits in order.
        tl.store(out_ptr + (pid_k * M + m[:, None]) * N + n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n_load).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_sum_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    m = tl.program_id(1)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    acc = tl.load(part_ptr + m * N + n, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + (s * M + m) * N + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _pow2_floor(value: int) -> int:
    return 1 << (max(1, value).bit_length() - 1)


@functools.cache
def _config(M: int, N: int, K: int, weight_dtype: torch.dtype, num_sms: int) -> Config:
    """Default launch shape: predictions for the H200 from the sm_90 build (instruction
    counts per weight byte); benchmarks/kernels/bench_gemv.py sweeps around it."""
    elem_bytes = torch.empty((), dtype=weight_dtype).element_size()
    fp8 = weight_dtype == FP8
    # Issue-rate model from the sm_90 build (loop instructions per weight byte; an SM must
    # take 16.5 bytes per clock at 4.3 TB/s): FMA bf16 needs ~24 / 37 / 59 % of the issue
    # rate at M = 1 / 2 / 4, FMA FP8 ~43 / 63 % at M = 1 / 2 (conversion ~1.6 instructions
    # per element on top of the M FMAs); DOT ~16 % (bf16) and ~50-60 % (FP8) at any M.
    # fp32 stays on FMA (exact fp32 products, no tf32).
    use_dot = elem_bytes < 4 and M > (1 if fp8 else 2)
    target_programs = 4 * num_sms  # several resident programs per SM, short tails
    if use_dot:
        block_k = min(256, max(16, triton.next_power_of_2(K)))
        # Wider tiles amortize the x tile and the padded MMA rows, while the grid stays deep.
        block_n = 16
        while block_n < 64 and triton.cdiv(N, 2 * block_n) >= target_programs:
            block_n *= 2
        num_warps = 2 if block_n == 16 else 4
        # cp.async pipelining keeps stages x tile bytes in flight per program.
        num_stages = 4
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
        while block_n > 1 and triton.cdiv(N, block_n) < target_programs:
            block_n //= 2
        num_stages = 1  # the FMA loop's loads are not pipelined by Triton: residency hides latency
    programs = triton.cdiv(N, block_n)
    split_k = 1
    if programs < 2 * num_sms:
        # Under two programs per SM even with the narrowest tile: split K into fp32
        # partials (one more launch), keeping >= 2 steps per split.
        split_k = min(triton.next_power_of_2(triton.cdiv(2 * num_sms, programs)), _pow2_floor(K // (2 * block_k)))
    return Config(block_n, block_k, num_warps, num_stages, use_dot, split_k)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # CPU interpreter runs: pretend an H200
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    config: Config | None = None,
) -> torch.Tensor:
    """Same contract as ref.gemv for M <= MAX_ROWS; config overrides the heuristic (benchmarks)."""
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
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    scale_kind = _SCALE_NONE
    stride_sn = 0
    if weight_scale is not None:
        scale_kind = _SCALE_CHANNEL if weight_scale.dim() == 1 else _SCALE_BLOCK
        expected = (N,) if scale_kind == _SCALE_CHANNEL else (triton.cdiv(N, SCALE_BLOCK), triton.cdiv(K, SCALE_BLOCK))
        if tuple(weight_scale.shape) != expected:
            raise ValueError(f"weight_scale must be {expected}, got {tuple(weight_scale.shape)}")
        weight_scale = weight_scale.float()  # no copy for the usual fp32 scales
        if weight_scale.stride(-1) != 1:
            weight_scale = weight_scale.contiguous()
        stride_sn = weight_scale.stride(0) if scale_kind == _SCALE_BLOCK else 0
    cfg = config or _config(M, N, K, weight.dtype, _device_sms(x.device))
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
    even_k = K % k_per_split == 0
    target = out if split_k == 1 else torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
    dummy = out  # never read: the constexpr flags compile those loads away
    _gemv_kernel[(triton.cdiv(N, cfg.block_n), split_k)](
        x,
        weight,
        dummy if weight_scale is None else weight_scale,
        dummy if bias is None else bias,
        target,
        M,
        N,
        K,
        x.stride(0),
        out.stride(0),
        stride_sn,
        k_per_split,
        SCALE=scale_kind,
        HAS_BIAS=bias is not None,
        SPLIT=split_k > 1,
        USE_DOT=cfg.use_dot,
        BLOCK_M=DOT_ROWS if cfg.use_dot else triton.next_power_of_2(M),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        VEC=vec,
        SPLIT_X=vec // vec_x if vec > vec_x else 1,
        K_SUB=k_sub,
        EVEN_K=even_k,
        FP8_ASM=x.is_cuda,  # inline PTX: not for the CPU interpreter
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split_k > 1:
        block = min(1024, triton.next_power_of_2(N))
        _split_sum_kernel[(triton.cdiv(N, block), M)](
            target,
            dummy if bias is None else bias,
            out,
            M,
            N,
            out.stride(0),
            SPLIT_K=split_k,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=4,
        )
    return out
