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
FlashAttention. Quantized caches (kernels/kv_quant, a format per cache) are read as codes and
scales and widened in registers to q's dtype, which then takes the cache dtype's place.

Split-K: program `split` of a q-block covers keys [split * L, (split + 1) * L) with
L = ceil(kv_hi / num_splits) rounded up to BLOCK_N but at least min_split, computed on
the device from the sequence length, so one grid serves every length: short sequences use
a few full splits and the other programs exit at once. Each split writes its normalised
partial output and log2-sum-exp; a second kernel merges them. Split 0 always holds key 0,
which every query sees, so every row has at least one non-empty split.

Mixed lengths with device-only sizes (split_short_requests, a step graph's padded step): a
single grid sized for the longest request would give a decode row's whole context to one
program with the prefill tile. There, requests of at most SPLIT_MAX_QUERY_LEN queries run in
a split-K launch of their own (partials indexed by request and query, not by token, so the
buffers do not grow with the step's rows) and the longer ones in a second, unsplit launch;
each launch's programs for the other kind exit at once.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ninfer.kernels.backend import fast_version
from ninfer.kernels.kv_quant.ref import check_head_dim, format_of, row_bytes
from ninfer.kernels.l2_prefetch import prefetch_l2
from ninfer.kernels.paged_attention import ref
from ninfer.kernels.pdl import pdl_enabled, pdl_sync

# Decode and short verification rows (at most this many queries per request) take the
# split-K path; longer chunks have enough q-blocks to fill the GPU on their own.
SPLIT_MAX_QUERY_LEN = 16
MAX_SPLITS = 128
# A padded step's short-request launch: its table holds max-concurrency rows but usually one or
# two decode rows, so the split plan assumes this many (a plan for the whole table would give a
# lone 4K decode row 6 splits instead of 16); partial buffers bounded by PADDED_MAX_SPLITS.
PADDED_ACTIVE_REQUESTS = 2
PADDED_MAX_SPLITS = 16
SPLIT_WAVES = 4  # split programs per SM at long contexts
SHORT_CONTEXT = 4096  # a context this long gets about two split programs per SM
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_M_D256 = 128


@triton.jit
def _e2m1_over_2_pow_14(code):
    """e2m1 codes (0..15, sign in bit 3) -> fp32 values times 2^-14. The three magnitude bits
    as an fp16's two low exponent bits and top mantissa bit give that exactly (0.5: a subnormal)."""
    c = code.to(tl.uint16)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _row_scales(ptr, off, k_pos, hi, SCALE_AT: tl.constexpr, MASKED: tl.constexpr):
    """Each row's fp32 scale, stored at byte SCALE_AT of the row (keys at or past hi read 0)."""
    scale_ptr = (ptr + off + SCALE_AT).to(tl.pointer_type(tl.float32), bitcast=True)
    if MASKED:
        return tl.load(scale_ptr, mask=k_pos < hi, other=0.0)
    return tl.load(scale_ptr)


@triton.jit
def _nvfp4_rows(
    ptr, off, k_pos, hi, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr
):
    """[BLOCK_N, BLOCK_D] fp32 code * block scale of the nvfp4 rows at byte offsets `off` (exact:
    at most 6 significant bits), before their row scales."""
    j = tl.arange(0, BLOCK_D // 2)  # byte j holds elements 2j (low nibble) and 2j + 1
    blk = tl.arange(0, BLOCK_D // 16)
    j_valid = j < HEAD_DIM // 2
    blk_valid = blk < HEAD_DIM // 16
    if MASKED:
        key_valid = k_pos < hi
        packed = tl.load(ptr + off[:, None] + j[None, :], mask=key_valid[:, None] & j_valid[None, :], other=0)
        block_scale = tl.load(
            ptr + off[:, None] + HEAD_DIM // 2 + blk[None, :], mask=key_valid[:, None] & blk_valid[None, :], other=0
        )
    else:
        packed = tl.load(ptr + off[:, None] + j[None, :], mask=j_valid[None, :], other=0)
        block_scale = tl.load(ptr + off[:, None] + HEAD_DIM // 2 + blk[None, :], mask=blk_valid[None, :], other=0)
    # 2^14 undoes _e2m1_over_2_pow_14's factor; a block's 16 values are 8 bytes.
    block_scale = block_scale.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
    per_byte = tl.broadcast_to(block_scale[:, :, None], (BLOCK_N, BLOCK_D // 16, 8))
    per_byte = tl.reshape(per_byte, (BLOCK_N, BLOCK_D // 2))
    low = _e2m1_over_2_pow_14(packed & 15) * per_byte
    high = _e2m1_over_2_pow_14(packed >> 4) * per_byte
    return tl.interleave(low, high)


@triton.jit
def _quantized_keys(
    k_ptr, k_off, k_pos, hi, d, d_valid, dtype: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, FMT: tl.constexpr, MASKED: tl.constexpr,
):
    """A [BLOCK_D, BLOCK_N] key tile without its row scales, in `dtype` (exact: int8 and e4m3
    codes, nvfp4 code * block scale fit a 16-bit float), and the row scales [BLOCK_N]."""
    if FMT == "nvfp4":
        k = tl.trans(_nvfp4_rows(k_ptr, k_off, k_pos, hi, HEAD_DIM, BLOCK_D, BLOCK_N, MASKED).to(dtype))
        scale_at: tl.constexpr = HEAD_DIM // 2 + HEAD_DIM // 16
    else:
        if MASKED:
            k_valid = k_pos < hi
            k = tl.load(k_ptr + k_off[None, :] + d[:, None], mask=k_valid[None, :] & d_valid[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + k_off[None, :] + d[:, None], mask=d_valid[:, None], other=0.0)
        k = k.to(dtype)
        scale_at: tl.constexpr = HEAD_DIM
    return k, _row_scales(k_ptr, k_off, k_pos, hi, scale_at, MASKED)


@triton.jit
def _quantized_values(
    v_ptr, v_off, k_pos, hi, d, d_valid, dtype: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, FMT: tl.constexpr, MASKED: tl.constexpr,
):
    """A [BLOCK_N, BLOCK_D] value tile, dequantized in fp32 and rounded once to `dtype` (the row
    scale varies along P @ V's reduction, so it cannot wait until after the product)."""
    if FMT == "nvfp4":
        v = _nvfp4_rows(v_ptr, v_off, k_pos, hi, HEAD_DIM, BLOCK_D, BLOCK_N, MASKED)
        scale_at: tl.constexpr = HEAD_DIM // 2 + HEAD_DIM // 16
    else:
        if MASKED:
            k_valid = k_pos < hi
            v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=k_valid[:, None] & d_valid[None, :], other=0.0)
        else:
            v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=d_valid[None, :], other=0.0)
        v = v.to(tl.float32)
        scale_at: tl.constexpr = HEAD_DIM
    return (v * _row_scales(v_ptr, v_off, k_pos, hi, scale_at, MASKED)[:, None]).to(dtype)


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
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    K_FMT: tl.constexpr,
    V_FMT: tl.constexpr,
):
    """One BLOCK_N tile of keys [start, start + BLOCK_N) into the online softmax.

    MASKED=False is for tiles every row sees whole (below the causal diagonal, inside the
    range): no key masks, no causal compare, no -inf guard. A quantized K or V (K_FMT,
    other than "plain") is read as codes and scales and widened to q's dtype; the key
    rows' scales multiply the scores, after Q @ K."""
    k_pos = start + tl.arange(0, BLOCK_N)
    if MASKED:
        k_valid = k_pos < hi
        page = tl.load(page_row + k_pos // PAGE_SIZE, mask=k_valid, other=0).to(tl.int64)
    else:
        page = tl.load(page_row + k_pos // PAGE_SIZE).to(tl.int64)
    in_page = k_pos % PAGE_SIZE
    k_off = page * stride_kp + in_page * stride_ko + kv_head * stride_kh
    v_off = page * stride_vp + in_page * stride_vo + kv_head * stride_vh
    # Quantized rows start 4-byte aligned (cache_format checks): codes load a word at a time.
    # (Here, not in the helpers: a hint on a function's argument is lost.)
    if K_FMT != "plain":
        k_off = tl.multiple_of(k_off, 4)
    if V_FMT != "plain":
        v_off = tl.multiple_of(v_off, 4)
    if K_FMT == "plain":
        if MASKED:
            k = tl.load(k_ptr + k_off[None, :] + d[:, None], mask=k_valid[None, :] & d_valid[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + k_off[None, :] + d[:, None], mask=d_valid[:, None], other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
    else:
        k, k_scale = _quantized_keys(
            k_ptr, k_off, k_pos, hi, d, d_valid, q.dtype, HEAD_DIM, BLOCK_D, BLOCK_N, K_FMT, MASKED
        )
        s = tl.dot(q, k, input_precision=PRECISION) * (k_scale * scale_log2)[None, :]
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
    if V_FMT == "plain":
        if MASKED:
            v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=k_valid[:, None] & d_valid[None, :], other=0.0)
        else:
            v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=d_valid[None, :], other=0.0)
    else:
        v = _quantized_values(v_ptr, v_off, k_pos, hi, d, d_valid, q.dtype, HEAD_DIM, BLOCK_D, BLOCK_N, V_FMT, MASKED)
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
    K_FMT: tl.constexpr,
    V_FMT: tl.constexpr,
    K_ROW: tl.constexpr,
    V_ROW: tl.constexpr,
    ROWS: tl.constexpr = 0,
    SHORT_QUERY: tl.constexpr = 16,
):
    """ROWS: 0 every request; 1 only requests of at most SHORT_QUERY queries, their split
    partials at row b * SHORT_QUERY + query (not the token); 2 only the longer requests.

    EARLY_KV (needs USE_PDL): the step's metadata (query starts, lengths, page table) are
    read before pdl_sync, and the K/V lines of this program's first tile that hold keys
    before the request's new queries are prefetched into L2 there; see paged_attention.

    K_FMT, V_FMT: each cache's format, "plain" or kv_quant's int8 / fp8 / nvfp4; K_ROW,
    V_ROW: elements of one cache row (HEAD_DIM when plain, its bytes when quantized)."""
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
        fetch = settled[:, None] & (lines < K_ROW)[None, :]
        k_off = page * stride_kp + in_page * stride_ko + kv_head * stride_kh
        v_off = page * stride_vp + in_page * stride_vo + kv_head * stride_vh
        prefetch_l2(k_ptr + k_off[:, None] + lines[None, :], fetch)
        V_LINE: tl.constexpr = 1024 // v_ptr.dtype.element_ty.primitive_bitwidth
        if V_LINE == LINE and V_ROW == K_ROW:
            prefetch_l2(v_ptr + v_off[:, None] + lines[None, :], fetch)
        else:  # k8v4: value rows narrower than key rows
            v_lines = tl.arange(0, KV_LINES) * V_LINE
            prefetch_l2(v_ptr + v_off[:, None] + v_lines[None, :], settled[:, None] & (v_lines < V_ROW)[None, :])
        pdl_sync(USE_PDL)  # q and the new keys are the previous launch's
    if block_start >= q_len:
        return
    if ROWS == 1:
        if q_len > SHORT_QUERY:
            return
    if ROWS == 2:
        if q_len <= SHORT_QUERY:
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
        if ROWS == 1:
            part_row = b.to(tl.int64) * SHORT_QUERY + block_start + t
        else:
            part_row = token
        part = (part_row * (NUM_KV_HEADS * G) + head) * num_splits + split
        if lo >= hi:
            # Nothing here: the merge gives this split weight 0 and never reads its output.
            tl.store(part_lse_ptr + part, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_valid)
            return

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if K_FMT == "plain":
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
            PAGE_SIZE, BLOCK_N, False, PRECISION, HEAD_DIM, BLOCK_D, K_FMT, V_FMT,
        )
    for start in range(unmasked_hi, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, start, hi, q_pos, page_row, k_ptr, v_ptr, kv_head, d, d_valid, scale_log2,
            stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh,
            PAGE_SIZE, BLOCK_N, True, PRECISION, HEAD_DIM, BLOCK_D, K_FMT, V_FMT,
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
    query_start_loc_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
    SHORT_QUERY: tl.constexpr = 0,
):
    """Program (row, head, d-slice). SHORT_QUERY = 0: row is the token; else row is request b,
    whose queries (at most SHORT_QUERY, else none) have partials at rows b * SHORT_QUERY + query."""
    pdl_sync(USE_PDL)  # before the first global load or store
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if SHORT_QUERY > 0:
        q_start = tl.load(query_start_loc_ptr + row)
        q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
        num_rows = tl.where(q_len > SHORT_QUERY, 0, q_len)
        for query in range(num_rows):
            _merge_row(part_out_ptr, part_lse_ptr, out_ptr, row * SHORT_QUERY + query, (q_start + query).to(tl.int64),
                       head, stride_ot, stride_oh, num_splits, NUM_HEADS, HEAD_DIM, BLOCK_D, BLOCK_S)
    else:
        _merge_row(part_out_ptr, part_lse_ptr, out_ptr, row, row, head, stride_ot, stride_oh, num_splits, NUM_HEADS,
                   HEAD_DIM, BLOCK_D, BLOCK_S)


@triton.jit
def _merge_row(part_out_ptr, part_lse_ptr, out_ptr, part_row, token, head, stride_ot, stride_oh, num_splits,
               NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One query row's output from its split partials (d-slice program_id(2))."""
    base = (part_row * NUM_HEADS + head) * num_splits
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


def cache_format(cache: torch.Tensor, head_dim: int) -> str:
    """The kernel's format constexpr for a cache: "plain" or kv_quant's name; checks a quantized
    cache's rows (width, 4-byte alignment of every row for the word loads and fp32 scales)."""
    fmt = format_of(cache)
    if fmt is None:
        return "plain"
    problem = check_head_dim(fmt, head_dim)
    if problem is None and cache.shape[-1] != row_bytes(fmt, head_dim):
        problem = f"{fmt} rows of head_dim {head_dim} are {row_bytes(fmt, head_dim)} bytes, not {cache.shape[-1]}"
    if problem is None and (cache.data_ptr() % 4 or any(stride % 4 for stride in cache.stride()[:-1])):
        problem = f"{fmt} rows must start 4-byte aligned, strides {cache.stride()}"
    if problem is not None:
        raise ValueError(problem)
    return fmt


def _block_config(
    head_dim: int, group: int, max_query_len: int, quantized: bool = False
) -> tuple[int, int, int, int, int]:
    """-> (BLOCK_Q, BLOCK_M, BLOCK_N, num_warps, num_stages). quantized: K or V is."""
    if max_query_len <= SPLIT_MAX_QUERY_LEN:
        block_q = triton.next_power_of_2(max_query_len)  # few compiled variants: 1, 2, 4, 8, 16
        block_m = max(16, triton.next_power_of_2(block_q * group))
        if head_dim > 128:
            # A [256, 64] bf16 K tile plus its V tile is 64 KB per pipeline stage. Quantized rows
            # are widened in registers: 4 warps spill there (ptxas, sm_90), 8 do not.
            if quantized:
                return block_q, block_m, 64 if block_m <= 16 else 32, 8, 2
            # Plain caches, best of the verification-row sweep (H100, docs/kernels.md): 4 warps up
            # to 64 rows (8 ran 1.2-1.5x slower at 32 and 64), the key tile halved at 64 rows.
            if block_m <= 32:
                return block_q, block_m, 64, 4, 2
            return block_q, block_m, 32, 4 if block_m <= 64 else 8, 2
        return block_q, block_m, 64, 4, 2
    # Prefill tiles, best of the H200 sweep (docs/kernels.md): head_dim 256 at 128 x 32 with
    # 8 warps (310 TFLOP/s vs 140 at 64 x 32), head_dim <= 128 at 64 x 64 with 4 warps.
    block_m = max(PREFILL_BLOCK_M_D256 if head_dim > 128 else PREFILL_BLOCK_M, triton.next_power_of_2(group))
    block_q = block_m // group
    if head_dim > 128:
        return block_q, block_m, 32, 8, 2
    return block_q, block_m, 64, 4, 2


@fast_version(ref.paged_attention)
def paged_attention(
    q, k_cache, v_cache, page_table, query_start_loc, seq_lens, scale, *, max_query_len, query_lens_cpu=None,
    seq_lens_cpu=None, prefetch_kv=False, split_short_requests=False,
    num_splits: int | None = None,  # None: split_plan's (tests and benchmarks override)
    min_split: int | None = None,  # None: split_plan's
    out: torch.Tensor | None = None,  # tests pass a poisoned buffer to see every row written
    block_m: int | None = None,  # tuning overrides for benchmarks (prefill BLOCK_M); None: _block_config
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """Reads no per-step host values.

    prefetch_kv (PDL launches): read query_start_loc, seq_lens and the page table before the
    PDL wait and prefetch the older keys' K/V into L2 there (see ninfer.kernels.pdl). Only
    when the launch just before this one writes none of those but the new keys' K/V: a
    decode step's prepare_qkv. split_short_requests: with max_query_len above
    SPLIT_MAX_QUERY_LEN, requests of at most that many queries take a split-K launch of
    their own (see the module docstring).
    """
    num_tokens = q.shape[0]
    num_requests = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_requests == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or page_table.stride(-1) != 1:
        raise ValueError("paged_attention needs unit-stride head_dim in the caches and a row-major page table")
    args = (q, k_cache, v_cache, page_table, query_start_loc, seq_lens, scale, out)
    tiles = {"block_m": block_m, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
    if split_short_requests and max_query_len > SPLIT_MAX_QUERY_LEN:
        if num_splits is None:
            short_block_n = _block_config(q.shape[2], q.shape[1] // k_cache.shape[2], SPLIT_MAX_QUERY_LEN)[2]
            planned, planned_min = split_plan(PADDED_ACTIVE_REQUESTS, k_cache.shape[2], 1, short_block_n, q.device)
            num_splits, min_split = min(planned, PADDED_MAX_SPLITS), min_split or planned_min
        _launch(*args, SPLIT_MAX_QUERY_LEN, num_splits, min_split, prefetch_kv, rows=1)
        # The launch before the second one (the first's merge) writes only out: the keys'
        # prefetch stays valid.
        _launch(*args, max_query_len, None, None, prefetch_kv, rows=2, **tiles)
    else:
        _launch(*args, max_query_len, num_splits, min_split, prefetch_kv, rows=0, **tiles)
    return out


def _launch(
    q, k_cache, v_cache, page_table, query_start_loc, seq_lens, scale, out, max_query_len, num_splits, min_split,
    prefetch_kv, *, rows, block_m=None, block_n=None, num_warps=None, num_stages=None,
) -> None:
    """One attention launch (and its split merge) over the requests ROWS = rows selects."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_requests = seq_lens.shape[0]
    k_fmt, v_fmt = cache_format(k_cache, head_dim), cache_format(v_cache, head_dim)
    quantized = (k_fmt, v_fmt) != ("plain", "plain")
    block_q, default_m, default_n, default_warps, default_stages = _block_config(
        head_dim, group, max_query_len, quantized
    )
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
    # Split partials by token, or (short requests only) by request and query.
    part_rows = num_requests * SPLIT_MAX_QUERY_LEN if rows == 1 else num_tokens
    if splits > 1:
        part_out = torch.empty((part_rows, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((part_rows, num_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # never touched without SPLIT_K
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Quantized rows are widened to q's dtype for the products.
    dot_dtypes = (k_cache.dtype if k_fmt == "plain" else q.dtype, v_cache.dtype if v_fmt == "plain" else q.dtype)
    precision = "ieee" if torch.float32 in dot_dtypes else "tf32"
    grid = (num_q_blocks, num_requests * num_kv_heads, splits)
    use_pdl = pdl_enabled(q)
    k_row_bytes, v_row_bytes = (c.shape[-1] * c.element_size() for c in (k_cache, v_cache))
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
        KV_LINES=triton.next_power_of_2(triton.cdiv(max(k_row_bytes, v_row_bytes), 128)),
        USE_PDL=use_pdl,
        K_FMT=k_fmt,
        V_FMT=v_fmt,
        K_ROW=k_cache.shape[-1],
        V_ROW=v_cache.shape[-1],
        ROWS=rows,
        SHORT_QUERY=SPLIT_MAX_QUERY_LEN,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=use_pdl,
    )
    if splits > 1:
        merge_block_d = min(block_d, 64)
        merge_rows = num_requests if rows == 1 else num_tokens  # a program per request (its rows) or token
        _merge_splits_kernel[(merge_rows, num_heads, triton.cdiv(head_dim, merge_block_d))](
            part_out,
            part_lse,
            out,
            query_start_loc,
            out.stride(0),
            out.stride(1),
            splits,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=merge_block_d,
            BLOCK_S=triton.next_power_of_2(splits),
            USE_PDL=use_pdl,
            SHORT_QUERY=SPLIT_MAX_QUERY_LEN if rows == 1 else 0,
            num_warps=4,
            launch_pdl=use_pdl,
        )


