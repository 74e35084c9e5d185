"""The MoE block at decode sizes in three launches: router choice + expert up-projections, then
down-projections of each slot, then their weighted sum with the shared expert's.

The block ran as eleven launches (router GEMV, top-k, expert up, expert down, combine, shared
gate_up, shared down, shared gate GEMV, sigmoid, add). Inside a CUDA graph with PDL launches
are cheap; what set the time was how many weight streams ran at once. Here, after the
router's GEMV:
  up:   program (token t, slot j, column tile): slots 0..k-1 are t's routed choices, each
        program taking the top-k from t's logits itself (the route kernel's helper, the same
        bits); slot k is the shared expert. act[t, j] = silu(x[t] @ Wg^T) * (x[t] @ Wu^T).
        Programs of column tile 0 also write the choice (weights, ids) for the down kernel.
  down: program (token t, column tile, split) computes w_j * (act[t, j] @ Wd_j^T) for the
        slots of its split (by default one each; slot k is the shared expert, weighted by
        sigmoid(x[t] . w_gate)) in fp32; gemv's split-sum kernel adds the splits in order and
        rounds once. With one split the down kernel sums all slots and writes the output.
Every pair streams its expert's weights on its own (no grouping of tokens that share an
expert): at <= MAX_TOKENS tokens of top-8 over 256 experts a repeat is rare, and an
expert read twice in the same launch mostly comes from L2.

The products are weight streams (one row of x per program): each thread multiplies 16-byte
weight vectors by x in registers and reduces across threads once per program, as the GEMV's
FMA path does (kernels/gemv). FP8 weights (weight-only) are widened exactly through fp16 as
there; a per-row scale multiplies each column's sum, a block scale each 16-wide vector's
(which lies in one 128-wide K block). NVFP4 weights (e2m1 codes two a byte, an e4m3 scale per
16, an fp32 scale per row: nvfp4_gemv/ref.py) are decoded exactly in registers as nvfp4_gemv's
kernel does, 32 codes a 16-byte vector; each 16-code block's sum takes its scale, each column's
total its row scale. Each matrix (experts, shared expert) has its own format and layout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ninfer.kernels.activation.triton import silu_mul
from ninfer.kernels.backend import fast_version
from ninfer.kernels.gemv.ref import FP8
from ninfer.kernels.gemv.triton import _to_fp32, sum_splits
from ninfer.kernels.moe.triton import _scales, top_k_choice
from ninfer.kernels.moe_block import ref
from ninfer.kernels.nvfp4_gemv.ref import BLOCK as NVFP4_BLOCK
from ninfer.kernels.nvfp4_gemv.triton import _decode
from ninfer.kernels.pdl import pdl_enabled, pdl_sync

Tile = tuple[int, ...]  # (BLOCK_N, BLOCK_K, num_warps); down: optionally the number of splits over the slots
# (up, down) tiles by the experts' weight bytes per element, the best of bench_moe.py --block on an H100
# (35B-A3B shapes, 1-4 tokens). up: BLOCK_N weight rows per program (half gate, half up), on
# one warp (the top-k's reductions need no barriers); down: every slot its own program (9
# splits), the fp32 partials then summed: one program per 16 columns had too few bytes in flight.
TILES: dict[float, tuple[Tile, Tile]] = {
    2: ((8, 256, 1), (16, 256, 4, 9)),
    1: ((8, 256, 1), (16, 256, 4, 9)),
    # NVFP4, BLOCK_K in codes; down takes a 35B-A3B row (I = 512) in one step. H100 sweep: up on 4
    # rows of 1,024 codes, 25.4 / 38.3 / 65.9 us at 1 / 2 / 4 tokens against 30.9 / 46.5 / 77.5 on 8
    # (issue-bound: 22-29 % of copy bandwidth).
    0.5: ((4, 1024, 1), (16, 512, 4, 9)),
}


@triton.constexpr_function
def _vec(dtype):
    """Weight elements per 16-byte vector."""
    return 128 // dtype.primitive_bitwidth


@triton.jit
def _row_products(
    x_row_ptr, w_ptr, scale_ptr, row_scale_ptr, n_load, stride_sn,
    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE: tl.constexpr, SCALE_ROWS: tl.constexpr,
    X_ROWS: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_N]: x_row . w[n] for the rows n_load of a row-major [*, K] weight at w_ptr;
    SCALE 0: none, 1: scale_ptr[n] per row, 2: block scales, row n // SCALE_ROWS of
    scale_ptr (stride_sn), column k // 128, 3: NVFP4 codes [*, K/2] (_nvfp4_row_products, with
    row_scale_ptr and X_ROWS; the other modes leave both unused).

    Tiles are [R, BLOCK_N, VEC] with R = BLOCK_K / VEC first, so a warp reads consecutive
    16-byte vectors of a weight row and x arrives in the weight's layout; the VEC products
    are summed in registers each step, the R partial sums once at the end."""
    if SCALE == 3:
        sums = _nvfp4_row_products(x_row_ptr, w_ptr, scale_ptr, row_scale_ptr, n_load, stride_sn, K, BLOCK_N, BLOCK_K, X_ROWS)
    else:
        VEC: tl.constexpr = _vec(w_ptr.dtype.element_ty)
        R: tl.constexpr = BLOCK_K // VEC
        r = tl.arange(0, R)
        k_in_tile = r[:, None, None] * VEC + tl.arange(0, VEC)[None, None, :]  # [R, 1, VEC]
        w_ptrs = w_ptr + n_load.to(tl.int64)[None, :, None] * K + k_in_tile
        x_ptrs = x_row_ptr + k_in_tile
        acc = tl.zeros([R, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if K % BLOCK_K == 0:
                w = tl.load(w_ptrs + k0)
                xv = tl.load(x_ptrs + k0)
            else:
                in_k = (k0 + k_in_tile) < K
                w = tl.load(w_ptrs + k0, mask=in_k, other=0.0)
                xv = tl.load(x_ptrs + k0, mask=in_k, other=0.0)
            part = tl.sum(xv.to(tl.float32) * _to_fp32(w), axis=2)
            if SCALE == 2:
                # Clamped: a masked tail past K would name a block column that does not exist.
                kb = tl.minimum((k0 + r * VEC) // 128, (K - 1) // 128)
                part *= tl.load(scale_ptr + (n_load // SCALE_ROWS)[None, :] * stride_sn + kb[:, None])
            acc += part
        sums = tl.sum(acc, axis=0)
        if SCALE == 1:
            sums *= tl.load(scale_ptr + n_load)
    return sums


@triton.constexpr_function
def _x_pieces(dtype):
    """16-byte loads of x per 32 codes (one 16-byte vector of them)."""
    return 32 * dtype.primitive_bitwidth // 128


@triton.jit
def _nvfp4_row_products(
    x_row_ptr, w_ptr, block_scale_ptr, row_scale_ptr, n_load, stride_sn,
    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_ROWS: tl.constexpr,
):  # fmt: skip
    """_row_products of NVFP4 rows (nvfp4_gemv/ref.py's layout): codes [*, K/2] at w_ptr, e4m3
    block scales [*, K/16] at block_scale_ptr (stride_sn), fp32 row scales at row_scale_ptr.

    A thread's 16-byte vector is 32 codes, two scale blocks, decoded in registers (nvfp4_gemv's
    _decode). Tiles are [BLOCK_N, R, 16] with R last but one, so a warp's threads lie along R
    (a row's consecutive vectors) and a thread meets the same 32 x values in all its rows. x
    comes as X_PIECES 16-byte pieces over X_ROWS rows (_x_rows), a layout equal to the weights'
    once the vector's bytes are regrouped in registers (as nvfp4_gemv's _step); x's even
    elements meet the low nibbles, the odd ones the high. Each block's sum takes its scale,
    each column's total the row scale (times the 2^14 that _decode leaves out)."""
    VEC_BYTES: tl.constexpr = 16
    VEC: tl.constexpr = 2 * VEC_BYTES  # codes per vector
    R: tl.constexpr = BLOCK_K // VEC if BLOCK_K >= VEC else 1  # a step reads at least one vector a row
    STEP: tl.constexpr = R * VEC
    X_PIECES: tl.constexpr = _x_pieces(x_row_ptr.dtype.element_ty)
    PIECE: tl.constexpr = VEC // X_PIECES  # x elements (codes) of one piece
    FOLD: tl.constexpr = 16384.0  # 2^14
    rows = n_load.to(tl.int64)[:, None, None]
    r = tl.arange(0, R)
    byte = r[None, :, None] * VEC_BYTES + tl.arange(0, VEC_BYTES)[None, None, :]  # [1, R, VEC_BYTES]
    w_ptrs = w_ptr + rows * (K // 2) + byte
    code = (tl.arange(0, X_PIECES)[:, None, None, None, None] * PIECE + r[None, None, None, :, None] * VEC
            + tl.arange(0, PIECE)[None, None, None, None, :])  # fmt: skip  [X_PIECES, 1, 1, R, PIECE]
    x_ptrs = x_row_ptr + code + tl.zeros([1, 1, X_ROWS, 1, 1], dtype=tl.int32)  # the same x for X_ROWS rows
    block = r[None, None, :] * 2 + tl.arange(0, 2)[None, :, None]  # [1, 2, R]: the vector's two scale blocks
    s_ptrs = block_scale_ptr + rows * stride_sn + block
    acc = tl.zeros([BLOCK_N, R], dtype=tl.float32)
    for k0 in range(0, K, STEP):
        if K % STEP == 0:
            packed = tl.load(w_ptrs + k0 // 2)
            xv = tl.load(x_ptrs + k0)
            s = tl.load(s_ptrs + k0 // 16)
        else:
            # K is a multiple of 16, so the tail masks whole scale blocks (a vector's second may be out).
            packed = tl.load(w_ptrs + k0 // 2, mask=(k0 + 2 * byte) < K, other=0)
            xv = tl.load(x_ptrs + k0, mask=(k0 + code) < K, other=0.0)
            s = tl.load(s_ptrs + k0 // 16, mask=(k0 + 16 * block) < K, other=0.0)
        # (piece, row in registers, row over threads, r, byte): each piece's bytes meet one x load.
        packed = tl.permute(tl.reshape(packed, [BLOCK_N // X_ROWS, X_ROWS, R, X_PIECES, PIECE // 2]), [3, 0, 1, 2, 4])
        low, high = _decode(packed)
        x_even, x_odd = tl.split(tl.reshape(xv.to(tl.float32), [X_PIECES, 1, X_ROWS, R, PIECE // 2, 2]))
        pieces = tl.sum(x_even * low + x_odd * high, axis=4)  # [X_PIECES, BLOCK_N / X_ROWS, X_ROWS, R]
        blocks = tl.sum(tl.reshape(pieces, [2, X_PIECES // 2, BLOCK_N, R]), axis=1)
        acc += tl.sum(blocks * tl.permute(s.to(tl.float32), [1, 0, 2]), axis=0)
    return tl.sum(acc, axis=1) * (tl.load(row_scale_ptr + n_load) * FOLD)


@triton.jit
def _glu_rows(col0, rows, BLOCK_N: tl.constexpr):
    """Weight rows of a gate | up matrix ([2 * rows, K]) for act columns col0 .. col0 + BLOCK_N/2:
    the gate rows, then the up rows of the same columns. Columns past `rows` re-read the last
    one (their act is not stored), so the loads need no masks."""
    HALF: tl.constexpr = BLOCK_N // 2
    idx = tl.arange(0, BLOCK_N)
    return tl.minimum(col0 + idx % HALF, rows - 1) + (idx // HALF) * rows


@triton.jit
def _store_act(sums, act_row_ptr, col0, rows, BLOCK_N: tl.constexpr):
    """act = silu(gate) * up from the [BLOCK_N] gate | up sums, with the roundings of the
    product then silu_and_mul (gate and up rounded to act's dtype first)."""
    HALF: tl.constexpr = BLOCK_N // 2
    dtype: tl.constexpr = act_row_ptr.dtype.element_ty
    sums = sums.to(dtype).to(tl.float32)
    gate, up = tl.split(tl.permute(tl.reshape(sums, [2, HALF]), [1, 0]))
    cols = col0 + tl.arange(0, HALF)
    tl.store(act_row_ptr + cols, silu_mul(gate, up, dtype).to(dtype), mask=cols < rows)


@triton.jit
def _block_up_kernel(
    x_ptr,
    logits_ptr,
    w_ptr,
    scale_ptr,
    row_scale_ptr,
    shared_w_ptr,
    shared_scale_ptr,
    shared_row_scale_ptr,
    act_ptr,
    route_w_ptr,
    ids_ptr,
    stride_xt,
    stride_lt,
    stride_we,
    stride_se,
    stride_sn,
    stride_re,
    shared_stride_sn,
    num_experts,
    SCALE: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SHARED_SCALE: tl.constexpr,
    SHARED_SCALE_ROWS: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    SHARED_INTER: tl.constexpr,
    ACT_COLS: tl.constexpr,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    slot = tl.program_id(0)
    t = slot // SLOTS
    j = slot % SLOTS
    tile = tl.program_id(1)
    col0 = tile * (BLOCK_N // 2)
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    act_row = act_ptr + slot.to(tl.int64) * ACT_COLS
    pdl_sync(USE_PDL)  # x and the logits come from the kernels just before
    if j < TOP_K:
        top_w, top_i = top_k_choice(logits_ptr + t.to(tl.int64) * stride_lt, num_experts, TOP_K, BLOCK_E, BLOCK_TOP, RENORMALIZE)
        pick = tl.arange(0, BLOCK_TOP) == j
        expert = tl.sum(tl.where(pick, top_i, 0), axis=0)
        if tile == 0:
            weight = tl.sum(tl.where(pick, top_w, 0.0), axis=0)
            tl.store(route_w_ptr + t * TOP_K + j, weight.to(route_w_ptr.dtype.element_ty))
            tl.store(ids_ptr + t * TOP_K + j, expert.to(tl.int32))
        if col0 < INTER:
            n_load = _glu_rows(col0, INTER, BLOCK_N)
            sums = _row_products(x_row, w_ptr + expert * stride_we, scale_ptr + expert * stride_se,
                                 row_scale_ptr + expert * stride_re, n_load, stride_sn,
                                 HIDDEN, BLOCK_N, BLOCK_K, SCALE, SCALE_ROWS, X_ROWS)  # fmt: skip
            _store_act(sums, act_row, col0, INTER, BLOCK_N)
    elif col0 < SHARED_INTER:
        n_load = _glu_rows(col0, SHARED_INTER, BLOCK_N)
        sums = _row_products(x_row, shared_w_ptr, shared_scale_ptr, shared_row_scale_ptr, n_load, shared_stride_sn,
                             HIDDEN, BLOCK_N, BLOCK_K, SHARED_SCALE, SHARED_SCALE_ROWS, X_ROWS)  # fmt: skip
        _store_act(sums, act_row, col0, SHARED_INTER, BLOCK_N)


@triton.jit
def _block_down_kernel(
    x_ptr,
    act_ptr,
    w_ptr,
    scale_ptr,
    row_scale_ptr,
    shared_w_ptr,
    shared_scale_ptr,
    shared_row_scale_ptr,
    shared_gate_ptr,
    route_w_ptr,
    ids_ptr,
    out_ptr,
    partial_ptr,
    stride_xt,
    stride_we,
    stride_se,
    stride_sn,
    stride_re,
    shared_stride_sn,
    stride_ot,
    NUM_TOKENS,
    SCALE: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SHARED_SCALE: tl.constexpr,
    SHARED_SCALE_ROWS: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    SHARED_INTER: tl.constexpr,
    ACT_COLS: tl.constexpr,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_load = tl.minimum(n, HIDDEN - 1)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    # SPLITS > 1: program (t, tile, split) sums slots [split * PER, (split + 1) * PER) into an
    # fp32 partial; a second launch adds the partials in split order (the same bits every run).
    PER: tl.constexpr = (SLOTS + SPLITS - 1) // SPLITS
    if HAS_SHARED:
        # x was written three launches earlier (the norm before the router's GEMV), so it is
        # complete once this program runs (kernels/pdl.py): these load while the up kernel drains.
        # Only the split holding the shared slot reads them (a predicate, not a branch, before the wait).
        h = tl.arange(0, BLOCK_H)
        gate_mask = (h < HIDDEN) & (tl.program_id(2) == TOP_K // PER)
        x_gate = tl.load(x_ptr + t * stride_xt + h, mask=gate_mask, other=0.0)
        w_gate = tl.load(shared_gate_ptr + h, mask=gate_mask, other=0.0)
    pdl_sync(USE_PDL)  # act and the choice are the up kernel's
    split = tl.program_id(2)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    act_row = act_ptr + t * SLOTS * ACT_COLS
    for j in tl.static_range(TOP_K):
        if j // PER == split:
            expert = tl.load(ids_ptr + t * TOP_K + j).to(tl.int64)
            weight = tl.load(route_w_ptr + t * TOP_K + j).to(tl.float32)
            acc += weight * _row_products(act_row + j * ACT_COLS, w_ptr + expert * stride_we, scale_ptr + expert * stride_se,
                                          row_scale_ptr + expert * stride_re, n_load, stride_sn,
                                          INTER, BLOCK_N, BLOCK_K, SCALE, SCALE_ROWS, X_ROWS)  # fmt: skip
    if HAS_SHARED:
        if TOP_K // PER == split:
            gate = tl.sum(x_gate.to(tl.float32) * w_gate.to(tl.float32), axis=0)
            gate = tl.sigmoid(gate.to(dtype).to(tl.float32))  # the logit rounded, as its Linear's output
            acc += gate * _row_products(act_row + TOP_K * ACT_COLS, shared_w_ptr, shared_scale_ptr, shared_row_scale_ptr,
                                        n_load, shared_stride_sn, SHARED_INTER, BLOCK_N, BLOCK_K, SHARED_SCALE,
                                        SHARED_SCALE_ROWS, X_ROWS)  # fmt: skip
    if SPLITS == 1:
        tl.store(out_ptr + t * stride_ot + n, acc.to(dtype), mask=n < HIDDEN)
    else:
        tl.store(partial_ptr + (split * NUM_TOKENS + t) * HIDDEN + n, acc, mask=n < HIDDEN)


class _Layout(NamedTuple):
    """A weight's scales as the kernels take them (kernels/moe's _Scales, plus the mode)."""

    ptr: torch.Tensor  # the weight itself (an unused pointer) when unscaled; NVFP4: the block scales
    stride_expert: int
    stride_row: int
    mode: int  # 0: none, 1: per row, 2: blocks, 3: NVFP4
    scale_rows: int
    row_ptr: torch.Tensor  # NVFP4's row scales (fp32); else ptr again, unused
    row_stride_expert: int = 0


NVFP4 = 3  # the mode of NVFP4 weights


def _layout(weight: torch.Tensor, scale, x: torch.Tensor, cols: int, weight_name: str, scale_name: str) -> _Layout:
    """weight [E, N, K] (scale [E, ...]) or a shared expert's [N, K] (scale [N] or 2-D); NVFP4:
    codes [E, N, K/2] or [N, K/2] with a (block_scale, row_scale) pair. cols: K."""
    if weight.dtype == torch.uint8 or isinstance(scale, tuple):
        return _nvfp4_layout(weight, scale, cols, weight_name, scale_name)
    if (weight.dtype == FP8) != (scale is not None) or weight.dtype not in (FP8, x.dtype):
        raise ValueError(
            f"{weight_name}: weights in x's dtype, e4m3 with their scales or NVFP4 codes with theirs"
            " (other quantized weights run kernels/moe)"
        )
    if not weight.is_contiguous():
        raise ValueError(f"{weight_name}: the weights must be contiguous")
    if weight.dim() == 2:
        weight, scale = weight[None], None if scale is None else scale[None]
    layout = _scales(weight, scale)
    mode = 0 if scale is None else 2 if layout.block_scales else 1
    return _Layout(layout.ptr, layout.stride_expert, layout.stride_row, mode, layout.scale_rows, layout.ptr)


def _nvfp4_layout(weight: torch.Tensor, scale, cols: int, weight_name: str, scale_name: str) -> _Layout:
    """NVFP4 operands checked as nvfp4_gemv/ref.py's kernel_operands does (ValueError naming the
    operand), with an expert dimension in front or none (the shared expert)."""
    if weight.dtype != torch.uint8:
        raise ValueError(
            f"{weight_name}: a (block_scale, row_scale) pair in {scale_name} takes uint8 NVFP4 codes, got {weight.dtype}"
        )
    if not isinstance(scale, tuple) or len(scale) != 2 or any(not isinstance(t, torch.Tensor) for t in scale):
        raise ValueError(f"{scale_name}: uint8 NVFP4 codes in {weight_name} need a (block_scale, row_scale) pair")
    if cols % NVFP4_BLOCK:
        raise ValueError(f"{weight_name}: NVFP4 needs K a multiple of {NVFP4_BLOCK}, got {cols}")
    lead = weight.shape[:-2]
    if weight.dim() not in (2, 3) or weight.shape[-1] * 2 != cols or not weight.is_contiguous():
        raise ValueError(f"{weight_name}: contiguous uint8 codes [..., N, {cols // 2}] (K = {cols}), got {tuple(weight.shape)}")
    block_scale, row_scale = scale
    expected = (*lead, weight.shape[-2], cols // NVFP4_BLOCK)
    if block_scale.dtype != torch.float8_e4m3fn or tuple(block_scale.shape) != expected or block_scale.stride(-1) != 1:
        raise ValueError(
            f"{scale_name} block_scale must be float8_e4m3fn {expected} with unit last stride,"
            f" got {block_scale.dtype} {tuple(block_scale.shape)}"
        )
    if tuple(row_scale.shape) != weight.shape[:-1]:
        raise ValueError(f"{scale_name} row_scale must be {tuple(weight.shape[:-1])}, got {tuple(row_scale.shape)}")
    row_scale = row_scale.float().contiguous()  # no copy for the usual fp32 scales
    if weight.dim() == 2:
        block_scale, row_scale = block_scale[None], row_scale[None]
    return _Layout(block_scale, block_scale.stride(0), block_scale.stride(1), NVFP4, 1, row_scale, row_scale.stride(0))


def _x_rows(block_n: int, block_k: int, num_warps: int) -> int:
    """NVFP4: the weight rows over which Triton spreads a [BLOCK_N, R, 16-byte] tile's threads and
    warps (R = BLOCK_K / 32 takes them first; the other rows lie in registers). x's tile spans as
    many, so it gets the weights' layout: no conversion through shared memory, no x loaded twice."""
    return max(1, min(block_n, 32 * num_warps // max(1, block_k // 32)))


@fast_version(ref.moe_block)
def moe_block(
    x, router_logits, top_k, renormalize, gate_up_proj, down_proj, shared_gate_up=None, shared_down=None, shared_gate=None,
    gate_up_scale=None, down_scale=None, shared_gate_up_scale=None, shared_down_scale=None,
    *,
    tiles: tuple[Tile, Tile] | None = None,
):  # fmt: skip
    """Same contract as ref.moe_block (weights 16-bit, fp32 under the interpreter, e4m3 or NVFP4), for
    any T, chosen up to MAX_TOKENS (kernels/moe_block/__init__.py). Capture-safe: the launch
    follows the shapes alone.
    tiles overrides the (up, down) launch shapes; for the benchmark."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up_proj.shape
    has_shared = shared_gate_up is not None
    if has_shared != (shared_down is not None) or has_shared != (shared_gate is not None):
        raise ValueError("the shared expert takes shared_gate_up, shared_down and shared_gate together")
    if x.stride(1) != 1 or router_logits.stride(1) != 1:
        raise ValueError("x and router_logits rows must be contiguous")
    inter = two_inter // 2
    shared_inter = shared_gate_up.shape[0] // 2 if has_shared else 0
    up = _layout(gate_up_proj, gate_up_scale, x, hidden, "gate_up_proj", "gate_up_scale")
    down = _layout(down_proj, down_scale, x, inter, "down_proj", "down_scale")
    if has_shared:
        shared_up = _layout(shared_gate_up, shared_gate_up_scale, x, hidden, "shared_gate_up", "shared_gate_up_scale")
        shared_dn = _layout(shared_down, shared_down_scale, x, shared_inter, "shared_down", "shared_down_scale")
        if shared_gate.dtype != x.dtype or not shared_gate.is_contiguous():
            raise ValueError("shared expert gate: a contiguous weight in x's dtype")
    else:
        shared_gate_up = shared_down = shared_gate = x  # unused pointers
        shared_up = shared_dn = _Layout(x, 0, 0, 0, 1, x)
    slots = top_k + has_shared
    act_cols = max(inter, shared_inter)
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    act = torch.empty((num_tokens * slots, act_cols), dtype=x.dtype, device=x.device)
    route_w = torch.empty((num_tokens, top_k), dtype=router_logits.dtype, device=x.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=x.device)
    up_tile, down_tile = tiles or TILES.get(0.5 if up.mode == NVFP4 else gate_up_proj.element_size(), TILES[2])
    (up_n, up_k, up_warps), (down_n, down_k, down_warps, *split) = up_tile, down_tile
    splits = min(split[0] if split else 1, slots)
    # fp32 partials of each split over the slots (with one split the down kernel writes out)
    partial = torch.empty((splits, num_tokens, hidden), dtype=torch.float32, device=x.device) if splits > 1 else out
    use_pdl = pdl_enabled(x)
    _block_up_kernel[(num_tokens * slots, triton.cdiv(act_cols, up_n // 2))](
        x, router_logits, gate_up_proj, up.ptr, up.row_ptr, shared_gate_up, shared_up.ptr, shared_up.row_ptr, act,
        route_w, ids, x.stride(0), router_logits.stride(0), gate_up_proj.stride(0), up.stride_expert, up.stride_row,
        up.row_stride_expert, shared_up.stride_row, num_experts,
        SCALE=up.mode, SCALE_ROWS=up.scale_rows, SHARED_SCALE=shared_up.mode, SHARED_SCALE_ROWS=shared_up.scale_rows,
        HIDDEN=hidden, INTER=inter, SHARED_INTER=shared_inter, ACT_COLS=act_cols, TOP_K=top_k, SLOTS=slots,
        RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_TOP=triton.next_power_of_2(top_k),
        BLOCK_N=up_n, BLOCK_K=up_k, X_ROWS=_x_rows(up_n, up_k, up_warps), USE_PDL=use_pdl, num_warps=up_warps,
        launch_pdl=use_pdl,
    )  # fmt: skip
    _block_down_kernel[(num_tokens, triton.cdiv(hidden, down_n), splits)](
        x, act, down_proj, down.ptr, down.row_ptr, shared_down, shared_dn.ptr, shared_dn.row_ptr, shared_gate, route_w,
        ids, out, partial, x.stride(0), down_proj.stride(0), down.stride_expert, down.stride_row, down.row_stride_expert,
        shared_dn.stride_row, out.stride(0), num_tokens,
        SCALE=down.mode, SCALE_ROWS=down.scale_rows, SHARED_SCALE=shared_dn.mode, SHARED_SCALE_ROWS=shared_dn.scale_rows,
        HIDDEN=hidden, INTER=inter, SHARED_INTER=shared_inter, ACT_COLS=act_cols, TOP_K=top_k, SLOTS=slots,
        HAS_SHARED=has_shared, SPLITS=splits, BLOCK_H=triton.next_power_of_2(hidden), BLOCK_N=down_n, BLOCK_K=down_k,
        X_ROWS=_x_rows(down_n, down_k, down_warps), USE_PDL=use_pdl, num_warps=down_warps, launch_pdl=use_pdl,
    )  # fmt: skip
    if splits > 1:
        sum_splits(partial, None, out, use_pdl)
    return out
