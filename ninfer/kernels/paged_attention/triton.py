"""Paged causal attention in Triton: one varlen kernel for prefill, decode and verify rows,
split over the sequence (split-K) when few query rows would leave the GPU idle.

Every per-step value (where each request's queries start, its sequence length, its pages)
is read on the device, and the host only supplies sizes that fix the grid and the
compile-time shapes: `max_query_len` and the number of splits. A decode round of B
requests therefore launches the same kernels with the same arguments every step, which
is what a CUDA graph replays.

One program handles BLOCK_Q consecutive query tokens of one request times the G query
heads that share one KV head (GQA): its BLOCK_M = BLOCK_Q * G rows (token-major, padded to
a power of two) share every K/V tile, so each KV byte is read once per program. Keys are
gathered token by token through the page table, so any page size works and BLOCK_N may
span several pages. Softmax is online in fp32 in the log2 domain (scale * log2(e) folded
into the scores); P is rounded to the cache dtype for the P @ V product, as in
FlashAttention.

Split-K: program `split` of a q-block covers keys [split * L, (split + 1) * L) with
L = ceil(kv_hi / num_splits) rounded up to BLOCK_N but at least min_split, computed on
the device from the sequence length, so one grid serves every length: short sequences use
a few full splits and the other programs exit at once. Each split writes its normalised
partial output and log2-sum-exp; a second kernel merges them. Split 0 always holds key 0,
which every query sees, so every row has at least one non-empty split.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ninfer.kernels.l2_prefetch import prefetch_l2
from ninfer.kernels.pdl import pdl_enabled, pdl_sync

# Decode and short verification rows (at most this many queries per request) take the
# split-K path; longer chunks have enough q-blocks to fill the GPU on their own.
SPLIT_MAX_QUERY_LEN = 16
MAX_SPLITS = 128
SPLIT_WAVES = 4  # split programs per SM at long contexts
SHORT_CONTEXT = 4096  # a context this long gets about two split programs per SM
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_M_D256 = 128


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    start,
    hi,
    q_pos,
    page_row,
    k_ptr,
    v_ptr,
    kv_head,
    d,
    d_valid,
    scale_log2,
    stride_kp,
    stride_ko,
    stride_kh,
    stride_vp,
    stride_vo,
    stride_vh,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One BLOCK_N tile of keys [start, start + BLOCK_N) into the online softmax.

    MASKED=False is for tiles every row sees whole (below the causal diagonal, inside the
    range): no key masks, no causal compare, no -inf guard."""
    k_pos = start + tl.arange(0, BLOCK_N)
    if MASKED:
        k_valid = k_pos < hi
        page = tl.load(page_row + k_pos // PAGE_SIZE, mask=k_valid, other=0).to(tl.int64)
    else:
        page = tl.load(page_row + k_pos // PAGE_SIZE).to(tl.int64)
    in_page = k_pos % PAGE_SIZE
    k_off = page * stride_kp + in_page * stride_ko + kv_head * stride_kh
    v_off = page * stride_vp + in_page * stride_vo + kv_head * stride_vh
    if MASKED:
        k = tl.load(k_ptr + k_off[None, :] + d[:, None], mask=k_valid[None, :] & d_valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + k_off[None, :] + d[:, None], mask=d_valid[:, None], other=0.0)
    s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
    if MASKED:
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; exponentiate against 0 so it stays NaN-free.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=k_valid[:, None] & d_valid[None, :], other=0.0)
    else:
        v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=d_valid[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    page_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    num_splits,
    min_split,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ko,
    stride_kh,
    stride_vp,
    stride_vo,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_pt,
    NUM_KV_HEADS: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
    EARLY_KV: tl.constexpr,
    KV_LINES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """EARLY_KV (needs USE_PDL): the step's metadata (query starts, lengths, page table) are
    read before pdl_sync, and the K/V lines of this program's first tile that hold keys
    before the request's new queries are prefetched into L2 there; see paged_attention."""
    q_block = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bh // NUM_KV_HEADS
    kv_head = pid_bh % NUM_KV_HEADS
    block_start = q_block * BLOCK_Q
    page_row = page_table_ptr + b.to(tl.int64) * stride_pt

    if not EARLY_KV:
        pdl_sync(USE_PDL)  # before the first global load or store (and before any early return)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    context = seq_len - q_len  # absolute position of the request's first query
    # Keys past the block's last query are masked for every row: never load them.
    kv_hi = tl.minimum(seq_len, context + block_start + BLOCK_Q)
    if SPLIT_K:
        # ceil(kv_hi / num_splits) rounded up to whole tiles, and at least min_split keys,
        # so short sequences use fewer, fuller splits (any min_split >= 1 is correct).
        per_split = ((kv_hi + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        per_split = tl.maximum(per_split, min_split)
        lo = split * per_split
        hi = tl.minimum(lo + per_split, kv_hi)
    else:
        lo = 0
        hi = kv_hi
    if EARLY_KV:
        # Keys before `context` were written by earlier steps; the new ones are the previous
        # launch's (prepare_qkv) and are left to the loads after the wait.
        k_pos = lo + tl.arange(0, BLOCK_N)
        settled = (k_pos < tl.minimum(hi, context)) & (block_start < q_len)
        page = tl.load(page_row + k_pos // PAGE_SIZE, mask=settled, other=0).to(tl.int64)
        in_page = k_pos % PAGE_SIZE
        LINE: tl.constexpr = 1024 // k_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line
        lines = tl.arange(0, KV_LINES) * LINE
        fetch = settled[:, None] & (lines < HEAD_DIM)[None, :]
        k_off = page * stride_kp + in_page * stride_ko + kv_head * stride_kh
        v_off = page * stride_vp + in_page * stride_vo + kv_head * stride_vh
        prefetch_l2(k_ptr + k_off[:, None] + lines[None, :], fetch)
        prefetch_l2(v_ptr + v_off[:, None] + lines[None, :], fetch)
        pdl_sync(USE_PDL)  # q and the new keys are the previous launch's
    if block_start >= q_len:
        return

    rows = tl.arange(0, BLOCK_M)
    t = rows // G
    head = kv_head * G + rows % G
    row_valid = (t < BLOCK_Q) & (block_start + t < q_len)
    token = (q_start + block_start + t).to(tl.int64)
    q_pos = context + block_start + t
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM

    if SPLIT_K:
        part = (token * (NUM_KV_HEADS * G) + head) * num_splits + split
        if lo >= hi:
            # Nothing here: the merge gives this split weight 0 and never reads its output.
            tl.store(part_lse_ptr + part, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_valid)
            return

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    q = q.to(k_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Whole tiles below the block's first query position are visible to every row.
    unmasked_hi = lo + tl.maximum(tl.minimum(hi, context + block_start) - lo, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, unmasked_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, start, hi, q_pos, page_row, k_ptr, v_ptr, kv_head, d, d_valid, scale_log2,
            stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh,
            PAGE_SIZE, BLOCK_N, False, PRECISION,
        )
    for start in range(unmasked_hi, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, start, hi, q_pos, page_row, k_ptr, v_ptr, kv_head, d, d_valid, scale_log2,
            stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh,
            PAGE_SIZE, BLOCK_N, True, PRECISION,
        )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if SPLIT_K:
        tl.store(
            part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=row_valid[:, None] & d_valid[None, :]
        )
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_valid)
    else:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_valid[None, :],
        )


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)  # before the first global load or store
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * NUM_HEADS + head) * num_splits
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(part_lse_ptr + base + s, mask=s < num_splits, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # empty splits: exp2(-inf) = 0
    # A slice of head_dim per program keeps the [splits, BLOCK_D] tile in registers.
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    used = weight > 0.0  # a split that saw no key of this row adds nothing: skip its load
    parts = tl.load(
        part_out_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
        mask=used[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_plan(num_requests: int, num_kv_heads: int, num_q_blocks: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """-> (num_splits, min_split): the split-K grid and the fewest keys a split takes.

    Depends only on sizes fixed for a captured batch (never on sequence lengths), so a
    graph replay and an eager step of the same batch run identical launches. Measured on an
    H200 (docs/kernels.md): at long contexts about SPLIT_WAVES programs per SM is best
    (more add partial outputs to write and merge, fewer leave bandwidth idle); at short
    contexts min_split keeps splits full, a 4K context filling about two programs per SM
    while the remaining programs exit at once.
    """
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else 8
    programs = num_requests * num_kv_heads * num_q_blocks
    wanted = max(1, SPLIT_WAVES * num_sms // programs)
    num_splits = min(MAX_SPLITS, 1 << (wanted.bit_length() - 1))  # a power of two at most `wanted`
    min_split = triton.cdiv(triton.cdiv(SHORT_CONTEXT * programs, 2 * num_sms), block_n) * block_n
    return num_splits, max(block_n, min_split)


def _block_config(head_dim: int, group: int, max_query_len: int) -> tuple[int, int, int, int, int]:
    """-> (BLOCK_Q, BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    if max_query_len <= SPLIT_MAX_QUERY_LEN:
        block_q = triton.next_power_of_2(max_query_len)  # few compiled variants: 1, 2, 4, 8, 16
        block_m = max(16, triton.next_power_of_2(block_q * group))
        if head_dim > 128:
            # A [256, 64] bf16 K tile plus its V tile is 64 KB per pipeline stage.
            return block_q, block_m, 64 if block_m <= 16 else 32, 4 if block_m <= 16 else 8, 2
        return block_q, block_m, 64, 4, 2
    # Prefill tiles, best of the H200 sweep (docs/kernels.md): head_dim 256 at 128 x 32 with
    # 8 warps (310 TFLOP/s vs 140 at 64 x 32), head_dim <= 128 at 64 x 64 with 4 warps.
    block_m = max(PREFILL_BLOCK_M_D256 if head_dim > 128 else PREFILL_BLOCK_M, triton.next_power_of_2(group))
    block_q = block_m // group
    if head_dim > 128:
        return block_q, block_m, 32, 8, 2
    return block_q, block_m, 64, 4, 2


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    query_lens_cpu: tuple[int, ...] | None = None,  # unused: the reference's host copies
    seq_lens_cpu: tuple[int, ...] | None = None,  # unused
    num_splits: int | None = None,  # None: split_plan's (tests and benchmarks override)
    min_split: int | None = None,  # None: split_plan's
    out: torch.Tensor | None = None,  # tests pass a poisoned buffer to see every row written
    block_m: int | None = None,  # tuning overrides for benchmarks (prefill BLOCK_M); None: _block_config
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prefetch_kv: bool = False,
) -> torch.Tensor:
    """Same contract as ref.paged_attention; reads no per-step host values.

    prefetch_kv (PDL launches): read query_start_loc, seq_lens and the page table before the
    PDL wait and prefetch the older keys' K/V into L2 there (see ninfer.kernels.pdl). Only
    when the launch just before this one writes none of those but the new keys' K/V: a
    decode step's prepare_qkv.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_requests = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_requests == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or page_table.stride(-1) != 1:
        raise ValueError("paged_attention needs unit-stride head_dim in the caches and a row-major page table")
    block_q, default_m, default_n, default_warps, default_stages = _block_config(head_dim, group, max_query_len)
    if block_m is not None and max_query_len > SPLIT_MAX_QUERY_LEN:
        block_q = max(1, block_m // group)
    else:
        block_m = default_m
    block_n = block_n or default_n
    num_warps = num_warps or default_warps
    num_stages = num_stages or default_stages
    num_q_blocks = triton.cdiv(max_query_len, block_q)
    splits = 1
    if max_query_len <= SPLIT_MAX_QUERY_LEN:
        splits, planned_min = split_plan(num_requests, num_kv_heads, num_q_blocks, block_n, q.device)
        splits = num_splits or splits
        min_split = min_split or planned_min
    if splits > 1:
        part_out = torch.empty((num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # never touched without SPLIT_K
    block_d = max(16, triton.next_power_of_2(head_dim))
    precision = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    grid = (num_q_blocks, num_requests * num_kv_heads, splits)
    use_pdl = pdl_enabled(q)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        page_table,
        query_start_loc,
        seq_lens,
        scale * 1.4426950408889634,  # log2(e): the kernel exponentiates with exp2
        splits,
        min_split,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        G=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SPLIT_K=splits > 1,
        PRECISION=precision,
        EARLY_KV=prefetch_kv and use_pdl,
        KV_LINES=triton.next_power_of_2(triton.cdiv(head_dim * k_cache.element_size(), 128)),
        USE_PDL=use_pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=use_pdl,
    )
    if splits > 1:
        merge_block_d = min(block_d, 64)
        _merge_splits_kernel[(num_tokens, num_heads, triton.cdiv(head_dim, merge_block_d))](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            splits,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=merge_block_d,
            BLOCK_S=triton.next_power_of_2(splits),
            USE_PDL=use_pdl,
            num_warps=4,
            launch_pdl=use_pdl,
        )
    return out
