"""Triton paged attention under Triton's CPU interpreter vs a float64 reference and ref.py.

Small shapes on purpose (the interpreter runs every program in numpy): several page sizes,
GQA ratios, head dims 16..256 (and a non-power-of-two one), varlen batches that mix decode,
verify and prefill rows, page tables with scattered pages, split-K with empty splits.
The GPU test (tests/gpu/test_paged_attention.py) covers the realistic sizes.
"""

from __future__ import annotations

import math
import multiprocessing
import os

import pytest
import torch

pytest.importorskip("triton")

from ninfer.kernels.paged_attention import ref  # noqa: E402


def _interpreted_call(name: str, kwargs: dict):
    """Runs in the worker, whose triton was imported with TRITON_INTERPRET=1."""
    import triton
    from triton.runtime import interpreter

    from ninfer.kernels.paged_attention import triton as kernels

    assert triton.knobs.runtime.interpret, "the worker must run Triton's interpreter"
    if not getattr(interpreter, "_ninfer_index_patch", False):
        # The interpreter keeps scalars as 1-element arrays and converts them for range()
        # with int(array), which numpy >= 2.4 refuses for arrays of ndim > 0.
        patch_tensor = interpreter._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        interpreter._patch_lang_tensor = _patch_lang_tensor
        interpreter._ninfer_index_patch = True
    return getattr(kernels, name)(**kwargs)


class _Interpreted:
    def __init__(self, pool):
        self.pool = pool

    def paged_attention(self, **kwargs) -> torch.Tensor:
        # A timeout, not apply(): a worker killed by a bad access would otherwise hang the test.
        return self.pool.apply_async(_interpreted_call, ("paged_attention", kwargs)).get(timeout=300)


@pytest.fixture(scope="module")
def kernels():
    """The Triton module in a fresh worker process under TRITON_INTERPRET=1.

    triton.jit picks interpreter or compiler when a function is decorated, triton's own
    helpers included, so the choice cannot be made in a process that (through
    transformers, fla ...) has already imported triton for real.
    """
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pool = multiprocessing.get_context("spawn").Pool(1)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    with pool:
        yield _Interpreted(pool)


def _case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, page_size, dtype, seed):
    """Random caches with scattered pages (rows of the page table interleave; page 0 unused)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    pages_per_request = [math.ceil(s / page_size) for s in seq_lens]
    max_pages = max(pages_per_request) + 1  # a spare column: the kernel must not read past seq_len
    num_pages = sum(pages_per_request) + 5
    order = torch.randperm(num_pages - 1, generator=gen) + 1
    page_table = torch.full((len(seq_lens), max_pages), -1, dtype=torch.int32)
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
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=page_table,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        scale=head_dim**-0.5,
        max_query_len=max(query_lens),
    )


def _float64_reference(case) -> torch.Tensor:
    """Direct softmax(q k^T) v per request in float64, gathering keys position by position."""
    q, k_cache, v_cache = case["q"].double(), case["k_cache"].double(), case["v_cache"].double()
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    starts = case["query_start_loc"].tolist()
    for b, seq_len in enumerate(case["seq_lens"].tolist()):
        pos = torch.arange(seq_len)
        pages = case["page_table"][b, pos // page_size].long()
        keys = k_cache[pages, pos % page_size].repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = v_cache[pages, pos % page_size].repeat_interleave(group, dim=1)
        rows = slice(starts[b], starts[b + 1])
        query_len = starts[b + 1] - starts[b]
        scores = torch.einsum("thd,shd->hts", q[rows], keys) * case["scale"]
        q_pos = torch.arange(seq_len - query_len, seq_len)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[rows] = torch.einsum("hts,shd->thd", scores.softmax(-1), values)
    return out


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _run(kernels, case, **kwargs) -> torch.Tensor:
    args = {k: v for k, v in case.items() if k != "max_query_len"}
    return kernels.paged_attention(**args, max_query_len=case["max_query_len"], **kwargs)


# fp32: products in full precision ("ieee" dots; the interpreter is numpy), so only
# summation order differs. fp16: P is rounded to fp16 before P @ V and the output is fp16
# (unit roundoff 4.9e-4). bf16 runs on the GPU only: the interpreter's bf16 dot multiplies
# the raw bit patterns (triton 3.6).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize(
    "query_lens, context_lens, num_heads, num_kv_heads, head_dim, page_size",
    [
        ((1,), (37,), 4, 4, 16, 16),  # MHA decode
        ((1, 1, 1), (0, 15, 70), 8, 2, 64, 16),  # decode batch, one row on its first token
        ((5, 1, 17), (0, 33, 9), 6, 1, 32, 8),  # prefill + decode + verify-sized rows, G=6
        ((70,), (0,), 2, 1, 64, 16),  # a prefill chunk longer than one q-block (BLOCK_Q=32)
        ((40, 3), (25, 50), 24, 4, 128, 32),  # Qwen3.5-27B grouping, chunk over a cached prefix
        ((2, 1), (20, 41), 16, 2, 256, 16),  # Qwen3.5-35B-A3B grouping, head_dim 256
        ((4, 3), (70, 33), 24, 4, 256, 16),  # 27B verification rows of K = 3: 32-row tile, 64 keys, 4 warps
        ((8, 5), (40, 300), 24, 4, 256, 16),  # K = 7: 64-row tile, 32 keys, 4 warps
        ((30, 1), (40, 9), 6, 1, 256, 16),  # head_dim 256 prefill tiles (BLOCK_M 128: 21 tokens x 6 heads)
        ((3, 1), (10, 5), 4, 2, 80, 1),  # non-power-of-two head_dim, one token per page
        ((9,), (100,), 4, 1, 16, 64),  # page larger than BLOCK_N
        ((20, 1, 70), (150, 200, 3), 4, 2, 64, 16),  # whole unmasked tiles below the diagonal, then masked ones
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_float64_and_ref(kernels, query_lens, context_lens, num_heads, num_kv_heads, head_dim, page_size, dtype):
    case = _case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, page_size, dtype, seed=sum(query_lens))
    want = _float64_reference(case)
    got = _run(kernels, case)
    assert got.dtype == dtype and got.shape == case["q"].shape
    assert torch.isfinite(got).all()
    assert _rel_err(got, want) < TOLERANCE[dtype]
    # The reference op agrees with the float64 check too (it is what the engine runs on CPU).
    expected = ref.paged_attention(**{k: v for k, v in case.items() if k != "max_query_len"}, max_query_len=case["max_query_len"])
    assert _rel_err(expected, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("num_splits, min_split", [(2, 1), (3, 1), (8, 1), (8, 40), (16, 64)])
@pytest.mark.parametrize("query_lens", [(1, 1, 1, 1), (4, 1, 2, 1)])
def test_split_k_matches_unsplit(kernels, num_splits, min_split, query_lens):
    """Split-K over lengths that leave some splits empty (seq 1, min_split past the end)
    and some uneven (min_split not a multiple of the tile)."""
    case = _case(query_lens, (0, 150, 31, 64), 12, 2, 32, 16, torch.float32, seed=num_splits + min_split)
    want = _float64_reference(case)
    split = _run(kernels, case, num_splits=num_splits, min_split=min_split)
    single = _run(kernels, case, num_splits=1)
    assert _rel_err(split, want) < 1e-5
    assert _rel_err(single, want) < 1e-5


def test_every_output_row_written(kernels):
    """Into a NaN-poisoned output: every row of every request must be overwritten."""
    case = _case((3, 1, 6), (4, 40, 0), 8, 4, 32, 16, torch.float32, seed=3)
    for splits in (1, 4):
        poisoned = torch.full_like(case["q"], float("nan"))
        got = _run(kernels, case, num_splits=splits, min_split=1, out=poisoned)
        assert torch.isfinite(got).all()
        assert _rel_err(got, _float64_reference(case)) < 1e-5


def test_reads_only_device_lengths(kernels):
    """The host copies are ignored: wrong ones must not change the result."""
    case = _case((2, 1), (5, 9), 4, 2, 16, 16, torch.float32, seed=5)
    right = _run(kernels, case)
    wrong = _run(kernels, case, query_lens_cpu=(7, 7), seq_lens_cpu=(1, 1))
    assert torch.equal(right, wrong)


@pytest.mark.parametrize("num_splits", [None, 4])
def test_split_short_requests_in_a_padded_step(kernels, num_splits):
    """A step graph's padded step: one max_query_len (the bucket) over decode, verify-sized and
    prompt requests, empty requests and rows of none. The short requests take their own split
    launch (partials by request), the prompts the unsplit one: every request's rows match, in
    a NaN-poisoned output."""
    query_lens, context_lens = (1, 40, 3, 16, 0, 0), (150, 0, 60, 90, 0, 0)
    case = _case(query_lens, context_lens, 12, 2, 32, 16, torch.float32, seed=11)
    want = _float64_reference(case)
    bucket = 64
    padded_q = torch.zeros(bucket, *case["q"].shape[1:])
    padded_q[: case["q"].shape[0]] = case["q"]
    padded = {**case, "q": padded_q, "max_query_len": bucket}
    kwargs = {"num_splits": num_splits, "min_split": 16} if num_splits else {}
    got = _run(kernels, padded, split_short_requests=True, out=torch.full_like(padded_q, float("nan")), **kwargs)
    real = case["q"].shape[0]
    assert torch.isfinite(got[:real]).all()
    assert _rel_err(got[:real], want) < 1e-5
    assert got[real:].isnan().all()  # rows of no request are left alone
