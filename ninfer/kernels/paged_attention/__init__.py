"""Paged KV writes and attention as ref.py defines them, run by triton.py on CUDA and cpu.py on CPU;
one long prefill chunk goes to dense_prefill (SDPA) instead (kernels/backend.py)."""

import torch

from ninfer.kernels.backend import cpu_impl, dispatched, fast_impl
from ninfer.kernels.paged_attention import dense_prefill, ref

store_kv = dispatched(__name__, ref.store_kv)


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
    """Causal attention of each request's new queries over its paged KV (see ref.py).

    The fast path reads only device tensors plus max_query_len (a grid size, fixed for a
    captured decode batch), so it can be replayed from a CUDA graph; the host copies
    query_lens_cpu / seq_lens_cpu serve the reference and the CPU version (cpu.py) and pick
    dense_prefill (SDPA) for one request's long prefill chunk. prefetch_kv is a launch hint
    for the fast path (see its docstring): same result. split_short_requests (a padded step's
    mixed lengths under one max_query_len): the fast path gives requests of few queries a
    split-K launch of their own; same result.
    """
    impl = fast_impl(__name__, "paged_attention", q)
    if impl is not None and dense_prefill.eligible(q, k_cache, query_lens_cpu, seq_lens_cpu, v_cache):
        return dense_prefill.paged_attention(q, k_cache, v_cache, page_table, scale, seq_lens_cpu[0])
    args = (q, k_cache, v_cache, page_table, query_start_loc, seq_lens, scale)
    lens = {"max_query_len": max_query_len, "query_lens_cpu": query_lens_cpu, "seq_lens_cpu": seq_lens_cpu}
    if impl is None:
        return (cpu_impl(__name__, "paged_attention", q) or ref.paged_attention)(*args, **lens)
    return impl(*args, **lens, prefetch_kv=prefetch_kv, split_short_requests=split_short_requests)
