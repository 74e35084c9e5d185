"""Paged causal attention for CPU tensors: the reference's math without its per-call overheads.

The reference gathers pages with advanced indexing and runs SDPA's math backend with a
boolean mask and GQA, which expands K/V per query head and scales K: at decode that costs
several times the attention itself (on 2 cores, ~0.4 ms per layer at a 350-token context).
Here a decode row (one query) is two batched products per KV head group over the gathered
pages, with no mask and no expansion; longer rows keep SDPA (its flash kernel when the rows
start the sequence). Computed in fp32 like ref.py, returned in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.kernels.backend import fast_version
from ninfer.kernels.paged_attention import ref
from ninfer.kernels.paged_attention.ref import cached_values


@fast_version(ref.paged_attention)
def paged_attention(
    q, k_cache, v_cache, page_table, query_start_loc, seq_lens, scale, *, max_query_len, query_lens_cpu=None,
    seq_lens_cpu=None, prefetch_kv=False, split_short_requests=False,
):
    """q [T, Hq, D] flat over requests -> [T, Hq, D]; the launch hints do not apply."""
    if query_lens_cpu is None:
        query_lens_cpu = tuple(query_start_loc.diff().tolist())
    if seq_lens_cpu is None:
        seq_lens_cpu = tuple(seq_lens.tolist())
    page_size, num_kv_heads = k_cache.shape[1:3]
    num_heads, head_dim = q.shape[1:]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    for b, (query_len, seq_len) in enumerate(zip(query_lens_cpu, seq_lens_cpu)):
        pages = page_table[b, : (seq_len + page_size - 1) // page_size]
        # index_select copies whole pages (contiguous blocks), unlike advanced indexing's element gather.
        keys = cached_values(k_cache, pages, seq_len, head_dim)
        values = cached_values(v_cache, pages, seq_len, head_dim)
        q_b = q[start : start + query_len].float()
        if query_len == 1:
            # [Hk, group, D] @ [Hk, D, S]: the strided K/V views go to BLAS as transposes, no copy.
            scores = torch.matmul(q_b.view(num_kv_heads, group, head_dim), keys.permute(1, 2, 0))
            probs = torch.softmax(scores.mul_(scale), dim=-1)
            o = torch.matmul(probs, values.transpose(0, 1)).view(1, num_heads, head_dim)
        else:
            # Imported here: it brings torch's compiler stack (engine/background_imports.py).
            from torch.nn.attention.bias import causal_lower_right

            # Queries are the last query_len positions: bottom-right causal (plain causal when they start it).
            # 4-D inputs: SDPA's CPU flash kernel takes only those (3-D ones run the math backend).
            o = F.scaled_dot_product_attention(
                q_b.transpose(0, 1)[None],
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                attn_mask=None if query_len == seq_len else causal_lower_right(query_len, seq_len),
                is_causal=query_len == seq_len,
                scale=scale,
                enable_gqa=True,
            )[0].transpose(0, 1)
        out[start : start + query_len] = o
        start += query_len
    return out
