"""CPU paged attention (ninfer/kernels/paged_attention/cpu.py) vs the reference, and its dispatch.

Varlen batches mixing decode rows, multi-token rows and prefill chunks (fresh, and after a
cached prefix), scattered pages with a spare page-table column, GQA ratios 1..4, page
sizes 1..16, fp32 and bf16 caches.
"""

from __future__ import annotations

import math

import pytest
import torch

from ninfer.kernels import paged_attention as dispatch
from ninfer.kernels.paged_attention import cpu, ref


def _case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, page_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    pages_per_request = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages_per_request) + 2
    order = torch.randperm(num_pages, generator=gen)
    page_table = torch.full((len(seq_lens), max(pages_per_request) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_request):
        page_table[b, :n] = order[used : used + n].int()
        used += n
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    args = (
        q,
        k_cache,
        v_cache,
        page_table,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        head_dim**-0.5,
    )
    lens = {"max_query_len": max(query_lens), "query_lens_cpu": tuple(query_lens), "seq_lens_cpu": tuple(seq_lens)}
    return args, lens


@pytest.mark.parametrize(
    "query_lens, context_lens",
    [
        ([1], [0]),  # the first token
        ([1], [15]),  # a full page
        ([1], [16]),  # one token into the next page
        ([1, 1, 1], [40, 3, 77]),  # a decode round
        ([7], [0]),  # a fresh prompt
        ([5], [30]),  # a chunk after a cached prefix
        ([1, 6, 1, 3], [20, 0, 9, 41]),  # decode and prefill rows together
    ],
)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_matches_reference_fp32(query_lens, context_lens, num_heads, num_kv_heads, page_size) -> None:
    args, lens = _case(query_lens, context_lens, num_heads, num_kv_heads, 32, page_size, torch.float32, 3)
    torch.testing.assert_close(cpu.paged_attention(*args, **lens), ref.paged_attention(*args, **lens), atol=2e-6, rtol=0)


@pytest.mark.parametrize("query_lens, context_lens", [([1, 1], [63, 5]), ([9, 1], [20, 70])])
def test_matches_reference_bf16(query_lens, context_lens) -> None:
    """Both compute in fp32 and round once to bf16: equal up to one bf16 rounding step."""
    args, lens = _case(query_lens, context_lens, 9, 3, 64, 16, torch.bfloat16, 5)
    out, expected = cpu.paged_attention(*args, **lens), ref.paged_attention(*args, **lens)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=8e-3, rtol=8e-3)


def test_without_host_lengths_reads_the_device_tensors() -> None:
    args, lens = _case([1, 4], [10, 3], 4, 2, 16, 4, torch.float32, 9)
    torch.testing.assert_close(
        cpu.paged_attention(*args, max_query_len=4), ref.paged_attention(*args, **lens), atol=2e-6, rtol=0
    )


def test_cpu_tensors_dispatch_to_cpu_unless_ref_is_forced(monkeypatch) -> None:
    args, lens = _case([1], [20], 4, 2, 16, 4, torch.float32, 11)
    calls = []
    monkeypatch.setattr(cpu, "paged_attention", lambda *a, **k: calls.append("cpu") or torch.zeros_like(a[0]))
    monkeypatch.setattr(ref, "paged_attention", lambda *a, **k: calls.append("ref") or torch.zeros_like(a[0]))
    dispatch.paged_attention(*args, **lens)
    assert calls == ["cpu"]
    calls.clear()
    monkeypatch.setenv("NINFER_KERNELS", "ref")
    dispatch.paged_attention(*args, **lens)
    assert calls == ["ref"]
