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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.activation import silu_and_mul
from ninfer.kernels.pdl import pdl_enabled, pdl_sync

DECODE_MAX_PAIRS = 128
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the (up, down) kernels by BLOCK_M, from the
# H200 sweep in benchmarks/kernels/bench_moe.py (docs/kernels.md): at BLOCK_M 16 (batch
# 1-2) narrow up tiles give enough programs to stream 8-16 experts; from BLOCK_M 32 on,
# wider tiles read longer runs per program.
TILES = {
    16: ((32, 128, 4, 4), (32, 128, 4, 4)),
    32: ((64, 128, 4, 3), (64, 64, 4, 4)),
    64: ((64, 128, 4, 3), (64, 64, 4, 4)),
}
Tile = tuple[int, int, int, int]


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
    e = tl.arange(0, BLOCK_E)
    mask = e < num_experts
    logits = tl.load(logits_ptr + t * stride_lt + e, mask=mask, other=float("-inf")).to(tl.float32)
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
    out_mask = j < TOP_K
    tl.store(weights_ptr + t * TOP_K + j, top_w.to(weights_ptr.dtype.element_ty), mask=out_mask)
    tl.store(ids_ptr + t * TOP_K + j, top_i, mask=out_mask)


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, *, num_warps: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
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


@triton.jit
def _moe_up_kernel(
    x_ptr,
    w_ptr,
    act_ptr,
    ids_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ap,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOP_K: tl.constexpr,
    DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)  # before the first global load or store (_group_rows loads the expert ids)
    expert, pairs, row_mask = _group_rows(ids_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, DECODE, BLOCK_M)
    if expert >= 0:
        tokens = pairs // TOP_K
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = n < INTER
        n_load = tl.minimum(n, INTER - 1)  # columns past INTER re-read the last one (store is masked)
        kk = tl.arange(0, BLOCK_K)
        p_x = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt + kk[None, :]
        p_gate = w_ptr + expert.to(tl.int64) * stride_we + n_load[None, :] * stride_wn + kk[:, None]
        p_up = p_gate + INTER * stride_wn
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
            acc_gate = tl.dot(b_x, b_gate, acc_gate)
            acc_up = tl.dot(b_x, b_up, acc_up)
            p_x += BLOCK_K
            p_gate += BLOCK_K
            p_up += BLOCK_K
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(
            act_ptr + pairs.to(tl.int64)[:, None] * stride_ap + n[None, :],
            act.to(act_ptr.dtype.element_ty),
            mask=row_mask[:, None] & mask_n[None, :],
        )


@triton.jit
def _moe_down_kernel(
    act_ptr,
    w_ptr,
    part_ptr,
    route_w_ptr,
    ids_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    stride_ap,
    stride_we,
    stride_wn,
    stride_pp,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
        p_w = w_ptr + expert.to(tl.int64) * stride_we + n_load[None, :] * stride_wn + kk[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            if INTER % BLOCK_K == 0:
                b_act = tl.load(p_act)
                b_w = tl.load(p_w)
            else:
                mask_k = (k0 + kk) < INTER
                b_act = tl.load(p_act, mask=mask_k[None, :], other=0.0)
                b_w = tl.load(p_w, mask=mask_k[:, None], other=0.0)
            acc = tl.dot(b_act, b_w, acc)
            p_act += BLOCK_K
            p_w += BLOCK_K
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


def fused_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    block_m: int | None = None,
    tiles: tuple[Tile, Tile] | None = None,
    grouped_mm: bool | None = None,
) -> torch.Tensor:
    """Same contract as ref.fused_experts. Capture-safe when T * top_k <= DECODE_MAX_PAIRS.

    Prefill runs on torch's grouped GEMM where it is supported (grouped_mm None: decide by
    grouped_mm_supported), else on the Triton grouped kernels. block_m (Triton prefill only)
    and tiles override the tile choice; for the benchmark.
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
    decode = num_pairs <= DECODE_MAX_PAIRS
    if not decode and (grouped_mm if grouped_mm is not None else grouped_mm_supported(x, gate_up_proj)):
        return _grouped_mm_experts(x, weights, expert_ids, gate_up_proj, down_proj)
    ids = expert_ids.reshape(-1).contiguous()
    route_w = weights.reshape(-1).contiguous()
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    # Weighted expert outputs in x's dtype (one rounding each; the combine sums them in fp32):
    # at prefill sizes they are the largest tensor the kernels write and read.
    part = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    if decode:
        block_m = max(16, triton.next_power_of_2(num_pairs))
        sorted_pairs, block_expert, num_programs = ids, ids, num_pairs  # unused pointers in decode mode
    else:
        # Rows per expert on average decide how full a block is; weights are read once per block.
        block_m = block_m or min(64, max(16, triton.next_power_of_2(triton.cdiv(num_pairs, num_experts))))
        sorted_pairs, block_expert, num_programs = _sort_by_expert(expert_ids, num_experts, block_m)
    up_cfg, down_cfg = tiles or TILES[min(block_m, 64)]
    # fp32 operands take twice the shared memory per pipeline stage; two stages keep the
    # tiles under the 227 KB a block may have.
    max_stages = 2 if x.element_size() > 2 else 8
    use_pdl = pdl_enabled(x)

    bn, bk, warps, stages = up_cfg
    _moe_up_kernel[(num_programs, triton.cdiv(inter, bn))](
        x,
        gate_up_proj,
        act,
        ids,
        sorted_pairs,
        block_expert,
        num_pairs,
        x.stride(0),
        gate_up_proj.stride(0),
        gate_up_proj.stride(1),
        act.stride(0),
        HIDDEN=hidden,
        INTER=inter,
        TOP_K=top_k,
        DECODE=decode,
        BLOCK_M=block_m,
        BLOCK_N=bn,
        BLOCK_K=bk,
        USE_PDL=use_pdl,
        num_warps=warps,
        num_stages=min(stages, max_stages),
        launch_pdl=use_pdl,
    )
    bn, bk, warps, stages = down_cfg
    _moe_down_kernel[(num_programs, triton.cdiv(hidden, bn))](
        act,
        down_proj,
        part,
        route_w,
        ids,
        sorted_pairs,
        block_expert,
        num_pairs,
        act.stride(0),
        down_proj.stride(0),
        down_proj.stride(1),
        part.stride(0),
        HIDDEN=hidden,
        INTER=inter,
        DECODE=decode,
        BLOCK_M=block_m,
        BLOCK_N=bn,
        BLOCK_K=bk,
        USE_PDL=use_pdl,
        num_warps=warps,
        num_stages=min(stages, max_stages),
        launch_pdl=use_pdl,
    )
    return _combine(part, out, top_k)
