"""Paged KV writes and attention as ref.py defines them, run by triton.py on CUDA and cpu.py on CPU;
one long prefill chunk goes to dense_prefill (SDPA) instead (kernels/backend.py)."""

import functools

from ninfer.kernels.backend import cpu_impl, dispatched, fast_impl
from ninfer.kernels.paged_attention import dense_prefill, ref

store_kv = dispatched(__name__, ref.store_kv)


@functools.wraps(ref.paged_attention)
def paged_attention(q, k_cache, v_cache, page_table, query_start_loc, seq_lens, scale, **lens_and_hints):
    # Where the fast path would run, one request's long prefill chunk goes to SDPA instead, picked
    # from the host copies of the lengths.
    impl = fast_impl(__name__, "paged_attention", q)
    query_lens_cpu, seq_lens_cpu = lens_and_hints.get("query_lens_cpu"), lens_and_hints.get("seq_lens_cpu")
    if impl is not None and dense_prefill.eligible(q, k_cache, query_lens_cpu, seq_lens_cpu, v_cache):
        return dense_prefill.paged_attention(q, k_cache, v_cache, page_table, scale, seq_lens_cpu[0])
    impl = impl or cpu_impl(__name__, "paged_attention", q) or ref.paged_attention
    return impl(q, k_cache, v_cache, page_table, query_start_loc, seq_lens, scale, **lens_and_hints)
