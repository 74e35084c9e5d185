"""Triton paged attention on the GPU vs ref.py (fp32 math) at the target models' shapes.

Qwen3.5-27B (24 q / 4 kv heads x 256), Qwen3.5-35B-A3B (16 / 2 x 256) and plain
Llama/Qwen shapes (head_dim 128 and 64); decode batches 1..8 with contexts up to 128K
(split-K), varlen batches that mix prefill chunks over a cached prefix with decode and
verify rows. Pages are scattered over the pool, outputs are NaN-poisoned before each run,
and every input is fresh random data.
"""

from __future__ import annotations

import math

import pytest
import torch

from ninfer.kernels.paged_attention import ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# bf16 inputs and output: the output alone rounds at 2^-9 relative (~2e-3 in norm);
# P is rounded to bf16 before P @ V. fp32 caches use full-precision dots.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}

SHAPES = {  # name: (q heads, kv heads, head_dim)
    "qwen3.5-27b": (24, 4, 256),
    "qwen3.5-35b-a3b": (16, 2, 256),
    "llama-8b": (32, 8, 128),
    "smol": (9, 3, 64),
}


def _kernels():
    from ninfer.kernels.paged_attention import triton as kernels

    return kernels


def _case(query_lens, context_lens, shape, page_size, dtype, seed):
    num_heads, num_kv_heads, head_dim = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    pages_per_request = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages_per_request) + 7
    order = torch.randperm(num_pages, generator=gen, device="cuda")
    page_table = torch.full((len(seq_lens), max(pages_per_request) + 2), -1, dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(pages_per_request):
        page_table[b, :n] = order[used : used + n].int()
        used += n
    shape_kv = (num_pages, page_size, num_kv_heads, head_dim)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return dict(
        q=torch.randn(starts[-1], num_heads, head_dim, generator=gen, device="cuda").to(dtype),
        k_cache=torch.randn(shape_kv, generator=gen, device="cuda").to(dtype),
        v_cache=torch.randn(shape_kv, generator=gen, device="cuda").to(dtype),
        page_table=page_table,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        scale=head_dim**-0.5,
        max_query_len=max(query_lens),
    )


def _reference(case) -> torch.Tensor:
    return ref.paged_attention(**{k: v for k, v in case.items() if k != "prefetch_kv"})


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _fast(case, **kwargs) -> torch.Tensor:
    out = torch.full_like(case["q"], float("nan"))
    got = _kernels().paged_attention(**case, out=out, **kwargs)
    torch.cuda.synchronize()
    assert got is out
    assert torch.isfinite(out).all(), "an output row was not written (or overflowed)"
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("prefetch_kv", [False, True])
def test_decode_matches_ref(shape, batch, prefetch_kv):
    gen = torch.Generator().manual_seed(batch)
    contexts = torch.randint(0, 5000, (batch,), generator=gen).tolist()
    contexts[0] = 0  # a request on its first token
    case = _case([1] * batch, contexts, shape, 16, torch.bfloat16, seed=batch)
    want = _reference(case)
    got = _fast(case, prefetch_kv=prefetch_kv)
    assert _rel_err(got, want) < TOLERANCE[torch.bfloat16]
    # A moving error is a race: the same inputs give the same bits, with or without early reads.
    assert torch.equal(got, _fast(case))
    assert torch.equal(got, _fast(case, prefetch_kv=True))


@pytest.mark.parametrize("shape", ["qwen3.5-27b", "qwen3.5-35b-a3b"])
@pytest.mark.parametrize("batch, context", [(1, 131071), (2, 65536), (8, 16384)])
def test_long_context_split_k(shape, batch, context):
    """Split-K at long contexts: default splits and one unsplit pass agree with the reference."""
    contexts = [context - 977 * b for b in range(batch)]
    case = _case([1] * batch, contexts, shape, 16, torch.bfloat16, seed=context + batch)
    want = _reference(case)
    split = _fast(case)
    assert _rel_err(split, want) < TOLERANCE[torch.bfloat16]
    assert torch.equal(_fast(case, prefetch_kv=True), split)
    single = _fast(case, num_splits=1)
    assert _rel_err(single, want) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("prefetch_kv", [False, True])
def test_varlen_prefill_decode_verify_mix(shape, page_size, prefetch_kv):
    """Prefill chunks over cached prefixes next to decode and 4-token verify rows."""
    query_lens = [1, 700, 4, 1, 129, 33]
    context_lens = [3000, 0, 90, 17, 2500, 1]
    case = _case(query_lens, context_lens, shape, page_size, torch.bfloat16, seed=page_size)
    want = _reference(case)
    assert _rel_err(_fast(case, prefetch_kv=prefetch_kv), want) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("max_query_len", [2, 4, 8, 16])
def test_verify_rows_split_k(max_query_len):
    """Multi-token verification rows take the split path (<= 16 queries per request)."""
    query_lens = [max_query_len, 1, max_query_len - 1]
    case = _case(query_lens, [40000, 700, 3], "qwen3.5-27b", 16, torch.bfloat16, seed=max_query_len)
    want = _reference(case)
    assert _rel_err(_fast(case), want) < TOLERANCE[torch.bfloat16]
    assert _rel_err(_fast(case, prefetch_kv=True), want) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype):
    case = _case([1, 300, 2], [2000, 50, 9000], "qwen3.5-27b", 16, dtype, seed=11)
    want = _reference(case)
    assert _rel_err(_fast(case), want) < TOLERANCE[dtype]


def test_through_dispatch_in_a_cuda_graph():
    """The op as the model calls it (prefetch_kv: the lengths and pages read before the PDL
    wait), captured once, replayed with new lengths, pages and data."""
    from ninfer.kernels.paged_attention import paged_attention

    num_heads, num_kv_heads, head_dim = SHAPES["qwen3.5-35b-a3b"]
    batch, page_size, num_pages, width = 3, 16, 2048, 640
    gen = torch.Generator(device="cuda").manual_seed(0)
    static = dict(
        q=torch.empty(batch, num_heads, head_dim, dtype=torch.bfloat16, device="cuda"),
        k_cache=torch.empty(num_pages, page_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda"),
        v_cache=torch.empty(num_pages, page_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda"),
        page_table=torch.zeros(batch, width, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.ones(batch, dtype=torch.int32, device="cuda"),
        scale=head_dim**-0.5,
        max_query_len=1,
        prefetch_kv=True,
    )

    def refill(seq_lens: list[int]) -> None:
        for name in ("q", "k_cache", "v_cache"):
            static[name].copy_(torch.randn(static[name].shape, generator=gen, device="cuda"))
        order = torch.randperm(num_pages, generator=gen, device="cuda").int()
        static["page_table"].fill_(-1)
        used = 0
        for b, seq_len in enumerate(seq_lens):
            n = math.ceil(seq_len / page_size)
            static["page_table"][b, :n] = order[used : used + n]
            used += n
        static["seq_lens"].copy_(torch.tensor(seq_lens, dtype=torch.int32))

    refill([100, 5000, 37])
    for _ in range(2):  # compile outside the capture
        paged_attention(**static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(**static)
    for seq_lens in ([4000, 3, 700], [1, 1, 1], [10000, 9000, 8000], [16, 17, 15]):
        refill(seq_lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert _rel_err(out, _reference(static)) < TOLERANCE[torch.bfloat16], seq_lens


@pytest.mark.parametrize("shape", ["qwen3.5-27b", "qwen3.5-35b-a3b", "llama-8b"])
@pytest.mark.parametrize("query_len, context", [(2048, 0), (1500, 2500)])  # fresh prompt; chunk after a prefix
def test_dense_prefill_on_flash_matches_ref(shape, query_len, context):
    """One request's long chunk goes to SDPA (dense_prefill) through the dispatcher (eligible,
    asserted): same reference error bound as the paged kernel, and close to the paged kernel."""
    from ninfer.kernels.paged_attention import dense_prefill, paged_attention

    case = _case([query_len], [context], shape, 16, torch.bfloat16, seed=query_len + context)
    seq_len = query_len + context
    hosts = dict(query_lens_cpu=(query_len,), seq_lens_cpu=(seq_len,))
    assert dense_prefill.eligible(case["q"], case["k_cache"], *hosts.values())
    want = _reference(case)
    got = paged_attention(**case, **hosts)
    assert got.shape == case["q"].shape and got.dtype == torch.bfloat16
    assert _rel_err(got, want) < TOLERANCE[torch.bfloat16]
    assert _rel_err(got, _fast(case)) < TOLERANCE[torch.bfloat16]  # and the paged kernel agrees
