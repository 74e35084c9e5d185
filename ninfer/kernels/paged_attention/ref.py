"""Paged causal attention reference: write the new K/V into their pages, then attend.

Covers prefill chunks over a cached prefix, decode rows and multi-token queries alike:
query i of request b sits at absolute position seq_len_b - query_len_b + i and sees
every cached key at or before it.
"""

import torch
import torch.nn.functional as F

from ninfer.kernels.kv_quant.ref import dequantize_rows, format_of, quantize_rows


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hk, D]; caches: [P, page_size, Hk, W]; slot_mapping: [T] = page * page_size + offset.
    A plain cache (W = D) takes the values cast to its dtype; a quantized one (kernels/kv_quant)
    each row's codes and scale."""
    for values, cache in ((k, k_cache), (v, v_cache)):
        fmt = format_of(cache)
        if fmt is None:
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, values.to(cache.dtype))
        else:  # as bytes: index_copy_ has no float8 kernel on every device
            rows = quantize_rows(values, fmt).view(torch.uint8)
            cache.view(torch.uint8).view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, rows)


def cached_values(cache: torch.Tensor, pages: torch.Tensor, num_tokens: int, head_dim: int) -> torch.Tensor:
    """The first num_tokens rows of the given pages as float32 [num_tokens, Hk, head_dim]
    (dequantized from a quantized cache)."""
    if format_of(cache) is None:
        return cache.index_select(0, pages).reshape(-1, *cache.shape[2:])[:num_tokens].float()
    rows = cache.view(torch.uint8).index_select(0, pages).reshape(-1, *cache.shape[2:])[:num_tokens]
    return dequantize_rows(rows.view(cache.dtype), head_dim)


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
    query_lens_cpu: tuple[int, ...] | None = None,
    seq_lens_cpu: tuple[int, ...] | None = None,
    prefetch_kv: bool = False,
    split_short_requests: bool = False,
) -> torch.Tensor:
    """q: [T, Hq, D] flat over requests -> [T, Hq, D]. GQA: Hq is a multiple of Hk. The caches
    hold plain or quantized rows (store_kv).

    Request b owns rows [query_start_loc[b], query_start_loc[b+1]) and has seq_lens[b]
    tokens in the cache (this step's included); page_table[b] lists its pages. The host
    copies query_lens_cpu / seq_lens_cpu, when given, spare the loop a device sync; without
    them it reads the device tensors. max_query_len is for the fast path's grid.
    Computed in fp32 (softmax included), returned in q's dtype.

    The fast path reads only device tensors plus max_query_len (a grid size, fixed for a
    captured decode batch), so it can be replayed from a CUDA graph. prefetch_kv and
    split_short_requests are its launch hints (see triton.py), with the same result.
    """
    if query_lens_cpu is None:
        query_lens_cpu = tuple(query_start_loc.diff().tolist())
    if seq_lens_cpu is None:
        seq_lens_cpu = tuple(seq_lens.tolist())
    page_size = k_cache.shape[1]
    out = torch.empty_like(q)
    start = 0
    for b, (query_len, seq_len) in enumerate(zip(query_lens_cpu, seq_lens_cpu)):
        num_pages = (seq_len + page_size - 1) // page_size
        pages = page_table[b, :num_pages].long()
        keys = cached_values(k_cache, pages, seq_len, q.shape[-1])
        values = cached_values(v_cache, pages, seq_len, q.shape[-1])
        q_b = q[start : start + query_len]
        first_pos = seq_len - query_len
        q_pos = torch.arange(first_pos, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [query_len, seq_len]
        o = F.scaled_dot_product_attention(
            q_b.transpose(0, 1).float(),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start : start + query_len] = o.transpose(0, 1).to(q.dtype)
        start += query_len
    return out
