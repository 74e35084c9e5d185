"""Routed MoE in Triton: fused router (softmax, top-k, renorm) and a grouped SwiGLU expert GEMM.

One file past the usual size on purpose: router, both expert stages and the combine share the
pair layout (how a program finds its rows) described below, which must change in all at once.

Routing: one program per token holds all E logits, takes the softmax in fp32 and picks the
top k by k rounds of argmax (ties go to the lowest expert id), renormalising in registers.
One launch instead of torch's five, and no host sync: capture-safe.

Experts: (token, choice) pairs P = T * top_k are grouped by expert; a program owns one
expert's group of rows and one output tile, so each selected expert's weight tile is read
once per step however many tokens chose it. Two stages, each one launch:
    up:   act[p]   = silu(x[t] @ Wg[e]^T) * (x[t] @ Wu[e]^T)     (fp32 accumulate, act in x's dtype)
    down: part[p]  = w[p] * (act[p] @ Wd[e]^T)                    (fp32 accumulate, part in x's dtype)
then a combine kernel sums each token's top_k partials in fp32 and rounds once.

How a program finds its rows:
- decode (P <= DECODE_MAX_PAIRS): program p is pair p; it loads all P expert ids and
  goes on only if p is the first pair that chose its expert, taking every pair with that
  expert as its rows (masked rows of one BLOCK_M >= P tile). No sort, no host values,
  fixed grid (P, tiles): the same launch every step, which a CUDA graph replays.
- prefill: pairs are sorted by expert on the device and each expert's run is padded to
  BLOCK_M rows (torch ops, no host sync); program b takes padded block b and the expert
  that owns it. The grid is the worst-case block count; blocks past the end exit.
  BLOCK_M follows the mean rows per expert (16..64): at a few thousand tokens over 256
  experts the step still reads every expert's weights, once per block, so emptier blocks
  cost bytes, not just FLOPs.
- prefill on sm_90+ in bf16: the two matmuls run on torch's grouped GEMM instead (CUTLASS,
  2.4x our Triton kernels' rate at 8K tokens), see _grouped_mm_experts.

FP8 experts (weight-only, ref.py's scale layouts), in decode and prefill alike: the same
kernels load e4m3 weight tiles (half the bytes: decode streams weights) and widen them in
registers by gemv's exact bit moves (_e4m3_bits: the value times 2^-120 into bf16's fields),
with the activation tile times 2^64 (exact) so products stay clear of fp32's subnormals. A
per-row scale multiplies each output column's sum once at the end; block scales multiply
each K step's product (BLOCK_K divides 128, so a step lies in one 128-wide K block). The
fold 2^56 rides with the scales. Activations stay in x's dtype. From FP8_GROUPED_MM_MIN_PAIRS
pairs (a long prefill chunk) the layer's experts are instead dequantized to bf16 in one pass
(dequantize_experts) for torch's grouped GEMM.

NVFP4 experts (ModelOpt's layout: e2m1 codes two a byte, an e4m3 scale per 16, an fp32 scale
per row) likewise: each K step loads code bytes and block scales and widens them to x's dtype as
the NVFP4 GEMM does (kernels/nvfp4_gemv's _weight_tile: code value times block scale is exact
in bf16), the row scale multiplying each column's sum at the end.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ninfer.kernels.activation import silu_and_mul
from ninfer.kernels.backend import fast_version
from ninfer.kernels.gemv.ref import SCALE_BLOCK, scale_rows_per_block
from ninfer.kernels.gemv.triton import _bits_exp, _e4m3_bits, _x_exp
from ninfer.kernels.moe import ref, scaled_grouped
from ninfer.kernels.moe.kernel_choice import DECODE_MAX_PAIRS, FP8_GROUPED_MM_MIN_PAIRS, tile_rows
from ninfer.kernels.nvfp4_gemm.triton import dequantize_nvfp4
from ninfer.kernels.nvfp4_gemv.triton import _weight_tile
from ninfer.kernels.pdl import pdl_enabled, pdl_sync

# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the (up, down) kernels by BLOCK_M, from the
# H200 sweep in benchmarks/kernels/bench_moe.py (docs/kernels.md): at BLOCK_M 16 (batch
# 1-2) narrow up tiles give enough programs to stream 8-16 experts; from BLOCK_M 32 on,
# wider tiles read longer runs per program.
TILES = {
    16: ((32, 128, 4, 4), (32, 128, 4, 4)),
    32: ((64, 128, 4, 3), (64, 64, 4, 4)),
    64: ((64, 128, 4, 3), (64, 64, 4, 4)),
}
# FP8 experts: BLOCK_K 128, one 128-wide scale block per K step. At BLOCK_M 16 wider tiles
# than bf16's keep as many bytes in flight (H200, 35B-A3B, graph-replayed: B = 1 / 2 took
# 18.8 / 22.7 us against 22.6 / 26.7 with the bf16 tiles); larger BLOCK_M: not yet tuned.
FP8_TILES = {
    16: ((64, 128, 4, 4), (64, 128, 4, 4)),
    32: ((64, 128, 4, 3), (64, 128, 4, 3)),
    64: ((64, 128, 4, 3), (64, 128, 4, 3)),
}
# NVFP4 experts: BLOCK_K a multiple of 16 (whole scale blocks per step). The up stage widens a
# gate and an up tile per step: at FP8's 128-wide steps it took 255 registers and spilled (sm_90
# build), at 64 it does not. Not yet measured on a GPU.
NVFP4_TILES = {
    16: ((64, 64, 4, 4), (64, 128, 4, 4)),
    32: ((64, 64, 4, 3), (64, 128, 4, 3)),
    64: ((64, 64, 4, 3), (64, 128, 4, 3)),
}
Tile = tuple[int, int, int, int]


@triton.jit
def top_k_choice(
    logits_ptr, num_experts, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr
):
    """One token's choice from its E logits at logits_ptr -> (fp32 weights [BLOCK_K], int64 expert
    ids [BLOCK_K]), the first TOP_K entries valid: softmax in fp32, k argmax rounds (ties to the
    lowest id), optionally renormalised. Shared with the fused MoE block (kernels/moe_block)."""
    e = tl.arange(0, BLOCK_E)
    mask = e < num_experts
    logits = tl.load(logits_ptr + e, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(mask, p, -1.0)  # probabilities are >= 0, so -1 is never picked
    j = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int64)
    for r in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
        top_w = tl.where(j == r, best, top_w)
        top_i = tl.where(j == r, idx.to(tl.int64), top_i)
        p = tl.where(e == idx, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    return top_w, top_i


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    stride_lt,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)  # before the first global load or store
    t = tl.program_id(0).to(tl.int64)
    top_w, top_i = top_k_choice(logits_ptr + t * stride_lt, num_experts, TOP_K, BLOCK_E, BLOCK_K, RENORMALIZE)
    j = tl.arange(0, BLOCK_K)
    out_mask = j < TOP_K
    tl.store(weights_ptr + t * TOP_K + j, top_w.to(weights_ptr.dtype.element_ty), mask=out_mask)
    tl.store(ids_ptr + t * TOP_K + j, top_i, mask=out_mask)


@fast_version(ref.route)
def route(router_logits, top_k, renormalize, *, num_warps: int = 1):
    """Same contract as ref.route: (weights [T, k] in the logits' dtype, expert ids [T, k] int64).

    One warp by default: the 2k reductions then need warp shuffles only, no barriers.
    """
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    use_pdl = pdl_enabled(router_logits)
    _route_kernel[(num_tokens,)](
        router_logits,
        weights,
        ids,
        router_logits.stride(0),
        num_experts,
        TOP_K=top_k,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        USE_PDL=use_pdl,
        num_warps=num_warps,
        launch_pdl=use_pdl,
    )
    return weights, ids


@triton.jit
def _group_rows(
    ids_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """-> (expert, pair index of each of the BLOCK_M rows, row mask); expert < 0: no work.

    Rows outside the mask still name a real pair (clamped), so the loads need no row mask
    and keep their full vectors; only the stores are masked.
    """
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    if DECODE:
        in_range = rows < num_pairs
        all_ids = tl.load(ids_ptr + rows, mask=in_range, other=-1)
        expert = tl.load(ids_ptr + pid)
        first = tl.min(tl.where(all_ids == expert, rows, BLOCK_M), axis=0)
        expert = tl.where(first == pid, expert, -1)  # a later pair of this expert: its owner does the work
        pairs = rows
        row_mask = in_range & (all_ids == expert)
    else:
        expert = tl.load(block_expert_ptr + pid)
        pairs = tl.load(sorted_pairs_ptr + pid * BLOCK_M + rows)
        row_mask = pairs < num_pairs  # padding rows hold num_pairs
    return expert, tl.minimum(pairs, num_pairs - 1), row_mask


@triton.constexpr_function
def _fold(dtype):
    """What the fp32 sums of bit-moved e4m3 weights times 2^_x_exp-scaled activations are short of."""
    return 2.0 ** (_bits_exp(dtype) - _x_exp(dtype))


@triton.jit
def _fp8_lhs(a, FP8: tl.constexpr):
    """The activation tile as FP8 products want it: times 2^_x_exp (exact), so that each product
    with a bit-moved e4m3 weight stays clear of fp32's subnormal range (gemv's _dot_tile)."""
    if FP8:
        a = a * (2.0 ** _x_exp(a.dtype))
    return a


@triton.jit
def _scale_ptrs(scale_ptr, expert, rows, stride_se, stride_sn, SCALE_ROWS: tl.constexpr):
    """[BLOCK_N] pointers to the scales of weight rows `rows` of `expert`: a per-row scale, or
    K block 0 of their block-scale row, row // SCALE_ROWS (128 x 128 blocks, or row blocks)."""
    return scale_ptr + expert.to(tl.int64) * stride_se + (rows // SCALE_ROWS) * stride_sn


@triton.jit
def _weight_dot(acc, a, w, s_ptrs, k0, BLOCK_SCALES: tl.constexpr, FP8_ASM: tl.constexpr):
    """acc + a @ w over the K step at k0. An e4m3 w is widened exactly to a's dtype (times
    2^-_bits_exp); block scales, times the fold, multiply this step's product."""
    if w.dtype != tl.float8e4nv:
        acc = tl.dot(a, w, acc)
    elif BLOCK_SCALES:
        w = _e4m3_bits(w, a.dtype, FP8_ASM)
        acc += tl.dot(a, w) * (tl.load(s_ptrs + k0 // 128) * _fold(a.dtype))[None, :]
    else:
        acc = tl.dot(a, _e4m3_bits(w, a.dtype, FP8_ASM), acc)
    return acc


@triton.jit
def _true_sums(acc, s_ptrs, dtype: tl.constexpr, FP8: tl.constexpr, BLOCK_SCALES: tl.constexpr):
    """The fp32 sums in true units: per-row scales (times the fold) applied once per column;
    block scales already were, step by step."""
    if FP8 and not BLOCK_SCALES:
        acc = acc * (tl.load(s_ptrs) * _fold(dtype))[None, :]
    return acc


@triton.jit
def _nvfp4_ptrs(w_ptr, scale_ptr, expert, n_load, stride_we, stride_wn, stride_se, stride_sn, BLOCK_K: tl.constexpr):
    """Pointers to K step 0 of an NVFP4 expert's rows n_load: code bytes [BLOCK_N, BLOCK_K/16, 8]
    and block scales [BLOCK_N, BLOCK_K/16] (a step is whole 16-code scale blocks)."""
    g = tl.arange(0, BLOCK_K // 16)
    byte = g[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    rows = n_load.to(tl.int64)
    codes = w_ptr + expert.to(tl.int64) * stride_we + rows[:, None, None] * stride_wn + byte
    scales = scale_ptr + expert.to(tl.int64) * stride_se + rows[:, None] * stride_sn + g[None, :]
    return codes, scales


@triton.jit
def _nvfp4_dot(acc, a, p_codes, p_scales, k0, K, EVEN_K: tl.constexpr):
    """acc + a @ w^T over the K step at k0 of an NVFP4 weight tile, widened to a's dtype exactly
    (code value times block scale; the row scale multiplies the finished sums). Scale blocks past K
    load zero codes and zero scales."""
    BLOCK_K: tl.constexpr = a.shape[1]
    if EVEN_K:
        packed = tl.load(p_codes + k0 // 2)
        scale = tl.load(p_scales + k0 // 16)
    else:
        in_k = (k0 + tl.arange(0, BLOCK_K // 16) * 16) < K
        packed = tl.load(p_codes + k0 // 2, mask=in_k[None, :, None], other=0)
        scale = tl.load(p_scales + k0 // 16, mask=in_k[None, :], other=0.0)
    return tl.dot(a, tl.trans(_weight_tile(packed, scale, a.dtype)), acc)


@triton.jit
def _moe_up_kernel(
    x_ptr,
    act_ptr,
    ids_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    stride_xt,
    stride_ap,
    w_ptr,
    scale_ptr,
    row_scale_ptr,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_re,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOP_K: tl.constexpr,
    DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    NVFP4: tl.constexpr,
    FP8_ASM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)  # before the first global load or store (_group_rows loads the expert ids)
    expert, pairs, row_mask = _group_rows(ids_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, DECODE, BLOCK_M)
    if NVFP4:  # constexpr: the e4m3 / 16-bit branch below is not compiled for code bytes
        if expert >= 0:
            _moe_up_nvfp4(x_ptr, w_ptr, scale_ptr, row_scale_ptr, act_ptr, expert, pairs, row_mask, stride_xt, stride_we,
                          stride_wn, stride_se, stride_sn, stride_re, stride_ap, HIDDEN, INTER, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    elif expert >= 0:
        tokens = pairs // TOP_K
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = n < INTER
        n_load = tl.minimum(n, INTER - 1)  # columns past INTER re-read the last one (store is masked)
        kk = tl.arange(0, BLOCK_K)
        p_x = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt + kk[None, :]
        p_gate = w_ptr + expert.to(tl.int64) * stride_we + n_load[None, :] * stride_wn + kk[:, None]
        p_up = p_gate + INTER * stride_wn
        s_gate = _scale_ptrs(scale_ptr, expert, n_load, stride_se, stride_sn, SCALE_ROWS)
        s_up = _scale_ptrs(scale_ptr, expert, INTER + n_load, stride_se, stride_sn, SCALE_ROWS)
        fp8: tl.constexpr = w_ptr.dtype.element_ty == tl.float8e4nv
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            if HIDDEN % BLOCK_K == 0:
                b_x = tl.load(p_x)
                b_gate = tl.load(p_gate)
                b_up = tl.load(p_up)
            else:
                mask_k = (k0 + kk) < HIDDEN
                b_x = tl.load(p_x, mask=mask_k[None, :], other=0.0)
                b_gate = tl.load(p_gate, mask=mask_k[:, None], other=0.0)
                b_up = tl.load(p_up, mask=mask_k[:, None], other=0.0)
            b_x = _fp8_lhs(b_x, fp8)
            acc_gate = _weight_dot(acc_gate, b_x, b_gate, s_gate, k0, BLOCK_SCALES, FP8_ASM)
            acc_up = _weight_dot(acc_up, b_x, b_up, s_up, k0, BLOCK_SCALES, FP8_ASM)
            p_x += BLOCK_K
            p_gate += BLOCK_K
            p_up += BLOCK_K
        x_dtype: tl.constexpr = x_ptr.dtype.element_ty
        acc_gate = _true_sums(acc_gate, s_gate, x_dtype, fp8, BLOCK_SCALES)
        acc_up = _true_sums(acc_up, s_up, x_dtype, fp8, BLOCK_SCALES)
        _store_act(acc_gate, acc_up, act_ptr, pairs, n, row_mask, mask_n, stride_ap)


@triton.jit
def _store_act(acc_gate, acc_up, act_ptr, pairs, n, row_mask, mask_n, stride_ap):
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(
        act_ptr + pairs.to(tl.int64)[:, None] * stride_ap + n[None, :],
        act.to(act_ptr.dtype.element_ty),
        mask=row_mask[:, None] & mask_n[None, :],
    )


@triton.jit
def _moe_up_nvfp4(
    x_ptr, w_ptr, scale_ptr, row_scale_ptr, act_ptr, expert, pairs, row_mask,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_re, stride_ap,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The up stage of one program on NVFP4 experts (the caller's rows and expert)."""
    tokens = pairs // TOP_K
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = n < INTER
    n_load = tl.minimum(n, INTER - 1)
    kk = tl.arange(0, BLOCK_K)
    p_x = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt + kk[None, :]
    c_gate, s_gate = _nvfp4_ptrs(w_ptr, scale_ptr, expert, n_load, stride_we, stride_wn, stride_se, stride_sn, BLOCK_K)
    c_up, s_up = _nvfp4_ptrs(w_ptr, scale_ptr, expert, INTER + n_load, stride_we, stride_wn, stride_se, stride_sn, BLOCK_K)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    even_k: tl.constexpr = HIDDEN % BLOCK_K == 0
    for k0 in range(0, HIDDEN, BLOCK_K):
        if even_k:
            b_x = tl.load(p_x + k0)
        else:
            b_x = tl.load(p_x + k0, mask=((k0 + kk) < HIDDEN)[None, :], other=0.0)
        acc_gate = _nvfp4_dot(acc_gate, b_x, c_gate, s_gate, k0, HIDDEN, even_k)
        acc_up = _nvfp4_dot(acc_up, b_x, c_up, s_up, k0, HIDDEN, even_k)
    r_rows = row_scale_ptr + expert.to(tl.int64) * stride_re
    acc_gate *= tl.load(r_rows + n_load)[None, :]
    acc_up *= tl.load(r_rows + INTER + n_load)[None, :]
    _store_act(acc_gate, acc_up, act_ptr, pairs, n, row_mask, mask_n, stride_ap)


@triton.jit
def _moe_down_kernel(
    act_ptr,
    part_ptr,
    route_w_ptr,
    ids_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    stride_ap,
    stride_pp,
    w_ptr,
    scale_ptr,
    row_scale_ptr,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_re,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    NVFP4: tl.constexpr,
    FP8_ASM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)  # before the first global load or store (_group_rows loads the expert ids)
    expert, pairs, row_mask = _group_rows(ids_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, DECODE, BLOCK_M)
    if expert >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = n < HIDDEN
        n_load = tl.minimum(n, HIDDEN - 1)
        kk = tl.arange(0, BLOCK_K)
        p_act = act_ptr + pairs.to(tl.int64)[:, None] * stride_ap + kk[None, :]
        fp8: tl.constexpr = w_ptr.dtype.element_ty == tl.float8e4nv
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if NVFP4:
            c_w, s_w = _nvfp4_ptrs(w_ptr, scale_ptr, expert, n_load, stride_we, stride_wn, stride_se, stride_sn, BLOCK_K)
            for k0 in range(0, INTER, BLOCK_K):
                if INTER % BLOCK_K == 0:
                    b_act = tl.load(p_act + k0)
                else:
                    b_act = tl.load(p_act + k0, mask=((k0 + kk) < INTER)[None, :], other=0.0)
                acc = _nvfp4_dot(acc, b_act, c_w, s_w, k0, INTER, INTER % BLOCK_K == 0)
            acc *= tl.load(row_scale_ptr + expert.to(tl.int64) * stride_re + n_load)[None, :]
        else:
            p_w = w_ptr + expert.to(tl.int64) * stride_we + n_load[None, :] * stride_wn + kk[:, None]
            s_w = _scale_ptrs(scale_ptr, expert, n_load, stride_se, stride_sn, SCALE_ROWS)
            for k0 in range(0, INTER, BLOCK_K):
                if INTER % BLOCK_K == 0:
                    b_act = tl.load(p_act)
                    b_w = tl.load(p_w)
                else:
                    mask_k = (k0 + kk) < INTER
                    b_act = tl.load(p_act, mask=mask_k[None, :], other=0.0)
                    b_w = tl.load(p_w, mask=mask_k[:, None], other=0.0)
                acc = _weight_dot(acc, _fp8_lhs(b_act, fp8), b_w, s_w, k0, BLOCK_SCALES, FP8_ASM)
                p_act += BLOCK_K
                p_w += BLOCK_K
            acc = _true_sums(acc, s_w, act_ptr.dtype.element_ty, fp8, BLOCK_SCALES)
        route_w = tl.load(route_w_ptr + pairs).to(tl.float32)
        acc = acc * route_w[:, None]
        tl.store(
            part_ptr + pairs.to(tl.int64)[:, None] * stride_pp + n[None, :],
            acc.to(part_ptr.dtype.element_ty),
            mask=row_mask[:, None] & mask_n[None, :],
        )


@triton.jit
def _combine_kernel(
    part_ptr,
    rows_ptr,
    route_w_ptr,
    out_ptr,
    stride_ot,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[t] = sum over j of token t's k expert outputs, in fp32, rounded once.
    GATHER: output of pair p = t * TOP_K + j is row rows[p] of part, times route weight w[p];
    else row p, already weighted."""
    pdl_sync(USE_PDL)  # before the first global load or store
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = n < HIDDEN
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        if GATHER:
            row = tl.load(rows_ptr + t * TOP_K + j)
            w = tl.load(route_w_ptr + t * TOP_K + j).to(tl.float32)
            acc += w * tl.load(part_ptr + row * HIDDEN + n, mask=mask, other=0.0).to(tl.float32)
        else:
            acc += tl.load(part_ptr + (t * TOP_K + j) * HIDDEN + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _combine(part: torch.Tensor, out: torch.Tensor, top_k: int, rows=None, route_w=None) -> torch.Tensor:
    num_tokens, hidden = out.shape
    block = min(1024, triton.next_power_of_2(hidden))
    use_pdl = pdl_enabled(out)
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        part,
        part if rows is None else rows,  # unused pointers without GATHER
        part if route_w is None else route_w,
        out,
        out.stride(0),
        HIDDEN=hidden,
        TOP_K=top_k,
        GATHER=rows is not None,
        BLOCK_N=block,
        USE_PDL=use_pdl,
        num_warps=4,
        launch_pdl=use_pdl,
    )
    return out


ORDER_BLOCK = 256  # pairs per program of the expert-order kernels


@triton.jit
def _expert_counts_kernel(
    ids_ptr, counts_ptr, num_pairs, num_blocks, num_experts, BINS: tl.constexpr, BLOCK: tl.constexpr
):
    """Program b: how many of pairs [b * BLOCK, (b + 1) * BLOCK) chose each expert, stored
    expert-major (counts[e, b]) so that one flat cumsum gives every (expert, block) its first row."""
    b = tl.program_id(0)
    pair = b * BLOCK + tl.arange(0, BLOCK)
    valid = pair < num_pairs
    ids = tl.load(ids_ptr + pair, mask=valid, other=0)
    counts = tl.histogram(ids.to(tl.int32), BINS, mask=valid)  # BINS: num_experts rounded up to a power of two
    experts = tl.arange(0, BINS)
    tl.store(counts_ptr + experts * num_blocks + b, counts, mask=experts < num_experts)


@triton.jit
def _expert_rows_kernel(
    ids_ptr,
    counts_ptr,
    cumulative_ptr,
    sorted_tokens_ptr,
    rows_ptr,
    ends_ptr,
    num_pairs,
    num_blocks,
    num_experts,
    TOP_K: tl.constexpr,
    BINS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program b: the sorted row of each of its pairs = the first row of (its expert, block b)
    (inclusive cumsum minus the count) + how many earlier pairs of the block chose the same
    expert. Program 0 also writes each expert's end row (grouped_mm's offsets)."""
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    pair = b * BLOCK + offs
    valid = pair < num_pairs
    ids = tl.load(ids_ptr + pair, mask=valid, other=0)
    cell = ids * num_blocks + b
    first = tl.load(cumulative_ptr + cell, mask=valid, other=0) - tl.load(counts_ptr + cell, mask=valid, other=0)
    # Pairs past the end sit after every real pair of the block, so they are never "earlier".
    earlier = (ids[:, None] == ids[None, :]) & (offs[None, :] < offs[:, None])
    row = first + tl.sum(earlier.to(tl.int32), axis=1)
    tl.store(sorted_tokens_ptr + row, (pair // TOP_K).to(tl.int64), mask=valid)
    tl.store(rows_ptr + pair, row.to(tl.int64), mask=valid)
    if b == 0:
        experts = tl.arange(0, BINS)
        live = experts < num_experts
        last = tl.load(cumulative_ptr + experts * num_blocks + num_blocks - 1, mask=live)
        tl.store(ends_ptr + experts, last.to(tl.int32), mask=live)


def expert_order(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs (token, choice) stably sorted by expert, no host sync: per-block expert counts,
    one cumsum over them (expert-major), then each pair's row.

    -> (sorted_tokens [P]: the token of each sorted row; rows [P]: the sorted row of pair
    p = t * k + j; ends [E] int32: one past each expert's last row, grouped_mm's offsets).
    """
    num_tokens, top_k = expert_ids.shape
    num_pairs = num_tokens * top_k
    ids = expert_ids.reshape(-1).contiguous()
    device = ids.device
    num_blocks = triton.cdiv(num_pairs, ORDER_BLOCK)
    counts = torch.empty((num_experts, num_blocks), dtype=torch.int32, device=device)
    bins = triton.next_power_of_2(num_experts)
    _expert_counts_kernel[(num_blocks,)](ids, counts, num_pairs, num_blocks, num_experts, BINS=bins, BLOCK=ORDER_BLOCK)
    cumulative = counts.view(-1).cumsum(0, dtype=torch.int32)
    sorted_tokens = torch.empty(num_pairs, dtype=torch.int64, device=device)
    rows = torch.empty(num_pairs, dtype=torch.int64, device=device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    _expert_rows_kernel[(num_blocks,)](
        ids, counts, cumulative, sorted_tokens, rows, ends, num_pairs, num_blocks, num_experts,
        TOP_K=top_k, BINS=bins, BLOCK=ORDER_BLOCK, num_warps=8,
    )  # fmt: skip
    return sorted_tokens, rows, ends


def _grouped_mm():
    """torch's grouped GEMM over jagged groups (F.grouped_mm; torch._grouped_mm before it was public), or None."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_supported(x: torch.Tensor, gate_up_proj: torch.Tensor) -> bool:
    """Prefill experts on torch's grouped GEMM: bf16 on sm_90+ (its CUTLASS kernel's domain)."""
    return (
        x.is_cuda
        and x.dtype == gate_up_proj.dtype == torch.bfloat16
        and _grouped_mm() is not None
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


def _grouped_mm_default(x: torch.Tensor, gate_up_proj: torch.Tensor, num_pairs: int) -> bool:
    """Prefill experts on torch's grouped GEMM by default: 16-bit experts where it is supported;
    FP8 and NVFP4 experts dequantized, from FP8_GROUPED_MM_MIN_PAIRS pairs."""
    if gate_up_proj.dtype not in (torch.float8_e4m3fn, torch.uint8):
        return grouped_mm_supported(x, gate_up_proj)
    return num_pairs >= FP8_GROUPED_MM_MIN_PAIRS and grouped_mm_supported(x, x.new_empty((1, 1, 1)))


# Whether FP8 experts with per-row scales take torch's FP8 x FP8 grouped GEMM at prefill sizes by
# default (scaled_grouped.py): off until timed against the dequantized bf16 route on a GPU
# (benchmarks/kernels/bench_moe.py --prefill-sweep prints both).
FP8_GROUPED_BY_DEFAULT = False


def _fp8_grouped_experts(
    x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    gate_up_scale: torch.Tensor, down_scale: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """_grouped_mm_experts on FP8 operands: the same order and combine, the two products and the
    activation from scaled_grouped.products (per-token e4m3 activations, the experts' row scales)."""
    top_k = expert_ids.shape[1]
    sorted_tokens, rows, ends = expert_order(expert_ids, gate_up_proj.shape[0])
    expert_out = scaled_grouped.products(x.index_select(0, sorted_tokens), ends, gate_up_proj, down_proj,
                                         gate_up_scale, down_scale)  # fmt: skip
    return _combine(expert_out, torch.empty_like(x), top_k, rows, weights.reshape(-1).contiguous())


def _grouped_mm_experts(
    x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor
) -> torch.Tensor:
    """Prefill: pairs sorted by expert (expert_order: one launch, no host sync), x rows gathered in that
    order, both expert matmuls as one grouped GEMM each, then each token's k outputs gathered
    back, weighted and summed in fp32 (_combine_kernel with GATHER).

    At prefill sizes the experts are compute-bound (256 rows per expert at an 8K chunk):
    bench_moe.py --prefill-sweep measured our Triton grouped kernels at 150-190 TFLOP/s
    there and torch.bmm over the same FLOPs at 590; the CUTLASS grouped GEMM takes the
    jagged groups with device-side offsets.
    """
    top_k = expert_ids.shape[1]
    sorted_tokens, rows, ends = expert_order(expert_ids, gate_up_proj.shape[0])
    grouped_mm = _grouped_mm()
    gate_up = grouped_mm(x.index_select(0, sorted_tokens), gate_up_proj.transpose(1, 2), offs=ends)
    expert_out = grouped_mm(silu_and_mul(gate_up), down_proj.transpose(1, 2), offs=ends)
    return _combine(expert_out, torch.empty_like(x), top_k, rows, weights.reshape(-1).contiguous())


def _sort_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pairs grouped by expert, each group padded to block_m rows, all on the device.

    -> (sorted_pairs [num_blocks * block_m], padding rows = num_pairs;
        block_expert [num_blocks], -1 past the last used block; num_blocks).
    num_blocks is the worst case: every used expert (at most min(E, P)) adds one partial block.
    """
    flat = expert_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    count_start = counts.cumsum(0) - counts
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - count_start[sorted_experts]
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs[padded_start[sorted_experts] + rank] = order
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_pairs, block_expert, num_blocks


class _Scales(NamedTuple):
    """An expert weight's scales as the kernels take them."""

    ptr: torch.Tensor  # the weight itself (an unused pointer) for 16-bit weights
    stride_expert: int
    stride_row: int
    block_scales: bool  # False: one scale per output row, or none
    scale_rows: int  # weight rows per scale row: 128 (128 x 128 blocks) or 1
    row_ptr: torch.Tensor | None = None  # NVFP4: the row scales [E, N] (ptr: the block scales)
    stride_row_expert: int = 0

    @property
    def nvfp4(self) -> bool:
        return self.row_ptr is not None


def _scales(weight: torch.Tensor, scale: ref.ExpertScales | None) -> _Scales:
    """weight [E, N, K]'s scales: none, per output row [E, N], or blocks [E, ceil(N/128) or N,
    ceil(K/128)]; NVFP4 codes [E, N, K/2]: (block scales [E, N, K/16], row scales [E, N])
    (ref.py's layouts)."""
    if scale is None:
        return _Scales(weight, 0, 0, False, 1)
    if isinstance(scale, tuple):
        return _nvfp4_scales(weight, *scale)
    if scale.dtype != torch.float32 or scale.stride(-1) != 1:
        raise ValueError("expert scales must be float32 with contiguous rows")
    if scale.dim() == 2 and scale.shape == weight.shape[:2]:
        return _Scales(scale, scale.stride(0), scale.stride(1), False, 1)
    rows = scale_rows_per_block(weight[0], scale[0]) if scale.dim() == 3 and len(scale) == len(weight) else None
    if rows is None:
        raise ValueError(f"scales {tuple(scale.shape)} fit no layout of expert weights {tuple(weight.shape)}")
    return _Scales(scale, scale.stride(0), scale.stride(1), True, rows)


def _weight_operands(weight: torch.Tensor, scales: _Scales) -> tuple:
    """An expert weight's pointers and strides in the grouped kernels' order: codes or values, scales
    (block scales for NVFP4), NVFP4's row scales (else the scales again, unread), strides."""
    row_ptr = scales.row_ptr if scales.nvfp4 else scales.ptr
    return (weight, scales.ptr, row_ptr, weight.stride(0), weight.stride(1), scales.stride_expert, scales.stride_row,
            scales.stride_row_expert)  # fmt: skip


def _nvfp4_scales(codes: torch.Tensor, block_scale: torch.Tensor, row_scale: torch.Tensor) -> _Scales:
    num_experts, rows, packed_cols = codes.shape
    if codes.dtype != torch.uint8:
        raise ValueError(f"NVFP4 experts: codes must be uint8 [E, N, K/2], got {codes.dtype}")
    if block_scale.dtype != torch.float8_e4m3fn or tuple(block_scale.shape) != (num_experts, rows, packed_cols // 8):
        raise ValueError(
            f"NVFP4 experts: block_scale must be float8_e4m3fn {(num_experts, rows, packed_cols // 8)},"
            f" got {block_scale.dtype} {tuple(block_scale.shape)}"
        )
    if row_scale.dtype != torch.float32 or tuple(row_scale.shape) != (num_experts, rows):
        raise ValueError(
            f"NVFP4 experts: row_scale must be float32 {(num_experts, rows)}, got {row_scale.dtype} {tuple(row_scale.shape)}"
        )
    if packed_cols % 8 or block_scale.stride(-1) != 1 or row_scale.stride(-1) != 1:
        raise ValueError("NVFP4 experts: K a multiple of 16, scales with contiguous rows")
    return _Scales(block_scale, block_scale.stride(0), block_scale.stride(1), False, 1, row_scale, row_scale.stride(0))


@triton.jit
def _dequantize_experts_kernel(
    w_ptr,
    scale_ptr,
    out_ptr,
    stride_se,
    stride_sn,
    N,
    K,
    BLOCK_SCALES: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (n < N)[:, None] & (k < K)[None, :]
    offsets = expert * N * K + n.to(tl.int64)[:, None] * K + k[None, :]
    w = tl.load(w_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # e4m3 -> fp32 is exact
    if BLOCK_SCALES:
        # BLOCK_K divides 128: the tile lies in one 128-wide K block, so a scale per row.
        kb = tl.program_id(2) * BLOCK_K // 128
        s = tl.load(scale_ptr + expert * stride_se + (n // SCALE_ROWS) * stride_sn + kb, mask=n < N)[:, None]
    else:
        s = tl.load(scale_ptr + expert * stride_se + n, mask=n < N)[:, None]
    tl.store(out_ptr + offsets, (w * s).to(out_ptr.dtype.element_ty), mask=mask)


@fast_version(ref.dequantize_experts)
def dequantize_experts(weight, scale, dtype, *, block_n: int | None = None, block_k: int | None = None):
    """Same contract as ref.dequantize_experts (the same bits: one fp32 product per weight).
    FP8: block_k divides 128 (default 64 x 128 tiles). NVFP4: nvfp4_gemm's dequantization and
    its default tile (the fastest on the 27B's dense shapes; not measured on experts' shapes)."""
    num_experts, rows, cols = weight.shape
    if isinstance(scale, tuple):
        scales = _nvfp4_scales(weight, *scale)
        if not weight.is_contiguous() or not scale[0].is_contiguous() or not scale[1].is_contiguous():
            raise ValueError("dequantize_experts takes contiguous NVFP4 codes and scales")
        tile = {"block_n": block_n} if block_n is not None else {}
        return dequantize_nvfp4(weight, scales.ptr, scales.row_ptr, dtype, block_k=block_k, **tile)
    block_n, block_k = block_n or 64, block_k or 128
    if 128 % block_k or block_k % 16:
        raise ValueError(f"block_k must divide 128 and be a multiple of 16, not {block_k}")
    if weight.dtype != torch.float8_e4m3fn or not weight.is_contiguous():
        raise ValueError("dequantize_experts takes contiguous float8_e4m3fn experts")
    scales = _scales(weight, scale)
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    _dequantize_experts_kernel[(num_experts, triton.cdiv(rows, block_n), triton.cdiv(cols, block_k))](
        weight, scales.ptr, out, scales.stride_expert, scales.stride_row, rows, cols,
        BLOCK_SCALES=scales.block_scales, SCALE_ROWS=scales.scale_rows, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out


@fast_version(ref.fused_experts)
def fused_experts(
    x, weights, expert_ids, gate_up_proj, down_proj, gate_up_scale=None, down_scale=None, *,
    block_m: int | None = None,
    tiles: tuple[Tile, Tile] | None = None,
    grouped_mm: bool | None = None,
    fp8_grouped: bool | None = None,
):
    """Same contract as ref.fused_experts. Capture-safe when T * top_k <= DECODE_MAX_PAIRS.

    Prefill runs on torch's grouped GEMM where it is supported (grouped_mm None: decide by
    _grouped_mm_default; FP8 experts dequantized to x's dtype first, or with fp8_grouped
    (default FP8_GROUPED_BY_DEFAULT) on FP8 operands where scaled_grouped supports them), else
    on the Triton grouped kernels. block_m
    (Triton prefill only) and tiles override the tile choice; for the benchmark.
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up_proj.shape
    inter = two_inter // 2
    top_k = expert_ids.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    if x.stride(1) != 1 or gate_up_proj.stride(2) != 1 or down_proj.stride(2) != 1:
        raise ValueError("x rows and expert weight rows must be contiguous")
    quantized = gate_up_proj.dtype in (torch.float8_e4m3fn, torch.uint8)
    if quantized != (gate_up_scale is not None) or quantized != (down_scale is not None) or down_proj.dtype != gate_up_proj.dtype:
        raise ValueError("FP8 and NVFP4 experts take gate_up_proj and down_proj of one format with both scales; others neither")
    fp8 = gate_up_proj.dtype == torch.float8_e4m3fn
    up_scales, down_scales = _scales(gate_up_proj, gate_up_scale), _scales(down_proj, down_scale)
    nvfp4 = up_scales.nvfp4
    if nvfp4:
        inter = down_proj.shape[2] * 2  # codes two a byte
    elif gate_up_proj.dtype == torch.uint8:
        raise ValueError("FP8 expert scales are one tensor (NVFP4's a (block_scale, row_scale) pair for uint8 codes)")
    decode, default_block_m = tile_rows(num_pairs, num_experts)
    if not decode and (grouped_mm if grouped_mm is not None else _grouped_mm_default(x, gate_up_proj, num_pairs)):
        use_fp8 = FP8_GROUPED_BY_DEFAULT if fp8_grouped is None else fp8_grouped
        if (use_fp8 and fp8 and scaled_grouped.eligible(x, gate_up_proj, gate_up_scale, down_scale)
                and scaled_grouped.supported(x.device)):  # fmt: skip
            return _fp8_grouped_experts(x, weights, expert_ids, gate_up_proj, down_proj, gate_up_scale, down_scale)
        if quantized:
            # Every expert of the layer, dequantized once: at these sizes nearly all are chosen,
            # and the bf16 grouped GEMM outruns quantized tiles widened in the Triton kernels.
            gate_up_proj = dequantize_experts(gate_up_proj, gate_up_scale, x.dtype)
            down_proj = dequantize_experts(down_proj, down_scale, x.dtype)
        return _grouped_mm_experts(x, weights, expert_ids, gate_up_proj, down_proj)
    ids = expert_ids.reshape(-1).contiguous()
    route_w = weights.reshape(-1).contiguous()
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    # Weighted expert outputs in x's dtype (one rounding each; the combine sums them in fp32):
    # at prefill sizes they are the largest tensor the kernels write and read.
    part = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    if decode:
        block_m = default_block_m
        sorted_pairs, block_expert, num_programs = ids, ids, num_pairs  # unused pointers in decode mode
    else:
        block_m = block_m or default_block_m
        sorted_pairs, block_expert, num_programs = _sort_by_expert(expert_ids, num_experts, block_m)
    up_cfg, down_cfg = tiles or (NVFP4_TILES if nvfp4 else FP8_TILES if fp8 else TILES)[min(block_m, 64)]
    if (up_scales.block_scales and SCALE_BLOCK % up_cfg[1]) or (down_scales.block_scales and SCALE_BLOCK % down_cfg[1]):
        raise ValueError(f"block-scaled experts need a BLOCK_K that divides {SCALE_BLOCK}, not {up_cfg[1]} / {down_cfg[1]}")
    if nvfp4 and (up_cfg[1] % 16 or down_cfg[1] % 16):
        raise ValueError(f"NVFP4 experts need a BLOCK_K of whole 16-code scale blocks, not {up_cfg[1]} / {down_cfg[1]}")
    # fp32 operands take twice the shared memory per pipeline stage: one stage keeps the tiles
    # under the 227 KB a block may have (the up stage's 64-row tiles asked 256 KiB at two, H100).
    max_stages = 1 if x.element_size() > 2 else 8
    use_pdl = pdl_enabled(x)
    # Inline PTX for the e4m3 bit moves (not for the CPU interpreter). NVFP4 tiles keep the fp16
    # decode: Triton 3.6 failed to build the lookup decode under the transposed operand (H100).
    fp8_asm = x.is_cuda

    routing = (ids, sorted_pairs, block_expert, num_pairs)

    def stage(cfg: Tile, scales: _Scales) -> dict:
        """A stage's launch options and scale layout constants."""
        block_n, block_k, warps, stages = cfg
        return dict(DECODE=decode, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_SCALES=scales.block_scales,
                    SCALE_ROWS=scales.scale_rows, NVFP4=scales.nvfp4, FP8_ASM=fp8_asm, USE_PDL=use_pdl,
                    num_warps=warps, num_stages=min(stages, max_stages), launch_pdl=use_pdl)  # fmt: skip

    _moe_up_kernel[(num_programs, triton.cdiv(inter, up_cfg[0]))](
        x, act, *routing, x.stride(0), act.stride(0), *_weight_operands(gate_up_proj, up_scales),
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, **stage(up_cfg, up_scales),
    )  # fmt: skip
    _moe_down_kernel[(num_programs, triton.cdiv(hidden, down_cfg[0]))](
        act, part, route_w, *routing, act.stride(0), part.stride(0), *_weight_operands(down_proj, down_scales),
        HIDDEN=hidden, INTER=inter, **stage(down_cfg, down_scales),
    )  # fmt: skip
    return _combine(part, out, top_k)
