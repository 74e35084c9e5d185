"""Prefill attention of one long request on torch's SDPA (FlashAttention-2 on CUDA).

Our Triton paged kernel runs prefill at ~310 TFLOP/s with head_dim 256, where SDPA's flash
kernel reaches 600-656 on the H200 (docs/kernels.md). A prefill chunk of a single request
has its whole context in its own pages, so: gather those pages into contiguous K/V (2 x
context x kv_heads x head_dim elements, small next to the attention's FLOPs), give every
query head its KV head, and run SDPA causally with bottom-right alignment (the chunk's
queries are the last query_len positions of the context). Batches of several requests,
short chunks, long contexts and decode stay on the paged kernel (which a CUDA graph replays).
A quantized cache (kernels/kv_quant) is dequantized to q's dtype as it is gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.kernels.kv_quant.ref import dequantize_rows, format_of

MIN_QUERY_LEN = 1024  # shorter chunks: the gather and the launch are not worth it
MAX_HEAD_DIM = 256  # FlashAttention-2's limit
# The gathered K and V, one copy per query head, are temporaries: at most this many bytes, so
# a long context (which the paged kernel reads in place) cannot eat the activation headroom
# the KV pool leaves (1 GiB with --kv-capacity auto). An 8K prompt of Qwen3.5 needs 134-201 MiB.
MAX_GATHER_BYTES = 256 << 20
# Quantized rows are dequantized this many values at a time: dequantize_rows' temporaries take
# up to 16 bytes a value (nvfp4's int64 code indices, fp32 products), so at most 32 MiB beside that bound.
DEQUANT_CHUNK_VALUES = 2 << 20


def eligible(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    query_lens: tuple[int, ...] | None,
    seq_lens: tuple[int, ...] | None,
    v_cache: torch.Tensor | None = None,
) -> bool:
    """One request's long chunk over a context of bounded size, 16-bit q, caches of q's dtype or
    quantized (v_cache: None when of k_cache's dtype), a head_dim flash takes."""
    return (
        query_lens is not None
        and seq_lens is not None
        and len(query_lens) == 1
        and query_lens[0] >= MIN_QUERY_LEN
        and 2 * seq_lens[0] * q.shape[1] * q.shape[2] * q.element_size() <= MAX_GATHER_BYTES
        and q.dtype in (torch.bfloat16, torch.float16)
        and all(cache.dtype == q.dtype or format_of(cache) for cache in (k_cache, v_cache) if cache is not None)
        and q.shape[-1] <= MAX_HEAD_DIM
        and q.shape[-1] % 8 == 0
    )


def _dequantized(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Quantized rows [S, kv_heads, W] -> values [S, kv_heads, head_dim] in dtype, a chunk at a time."""
    out = torch.empty(*rows.shape[:-1], head_dim, dtype=dtype, device=rows.device)
    chunk = max(1, DEQUANT_CHUNK_VALUES // (rows.shape[1] * head_dim))
    for start in range(0, rows.shape[0], chunk):
        out[start : start + chunk] = dequantize_rows(rows[start : start + chunk], head_dim)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    scale: float,
    seq_len: int,
) -> torch.Tensor:
    """q [T, H, D]: the last T of the request's seq_len positions; its pages are page_table row 0.
    Returns [T, H, D] in q's dtype (the contract of ref.paged_attention for one request)."""
    num_queries, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    pages = page_table[0, : -(-seq_len // page_size)].long()  # no triton here: CPU installs may lack it
    group = num_heads // num_kv_heads

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # [S, kv_heads, D] -> [1, H, S, D], query head h reading KV head h // group
        context = cache.index_select(0, pages).reshape(-1, num_kv_heads, cache.shape[-1])[:seq_len]
        if format_of(cache) is not None:
            context = _dequantized(context, head_dim, q.dtype)
        return context.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)

    query = q.transpose(0, 1).unsqueeze(0)
    if seq_len == num_queries:
        out = F.scaled_dot_product_attention(query, gather(k_cache), gather(v_cache), is_causal=True, scale=scale)
    else:
        # Imported here: it brings torch's compiler stack (engine/background_imports.py).
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(num_queries, seq_len)
        out = F.scaled_dot_product_attention(query, gather(k_cache), gather(v_cache), attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1).contiguous()
