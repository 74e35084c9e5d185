"""Prefill attention of one long request on torch's SDPA (ninfer/kernels/paged_attention/dense_prefill.py)
vs the reference, on CPU (SDPA's math backend); tests/gpu/test_paged_attention.py runs it on flash."""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.kv_quant import quantize_rows, row_bytes
from ninfer.kernels.paged_attention import dense_prefill, ref


def _case(query_len: int, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    page_size, num_pages = 16, (seq_len + 15) // 16 + 3
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    pages = torch.randperm(num_pages, generator=gen)[: (seq_len + 15) // 16]  # scattered pages
    page_table = torch.zeros(1, num_pages, dtype=torch.int32)
    page_table[0, : pages.numel()] = pages.int()
    q = torch.randn(query_len, num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, page_table


@pytest.mark.parametrize("query_len, seq_len", [(40, 40), (40, 100)])  # fresh prompt; chunk after a prefix
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 64), (6, 1, 32), (4, 4, 16)])
def test_matches_reference(query_len, seq_len, num_heads, num_kv_heads, head_dim) -> None:
    q, k_cache, v_cache, page_table = _case(query_len, seq_len, num_heads, num_kv_heads, head_dim, torch.float32, 7)
    scale = head_dim**-0.5
    out = dense_prefill.paged_attention(q, k_cache, v_cache, page_table, scale, seq_len)
    expected = ref.paged_attention(
        q, k_cache, v_cache, page_table, torch.tensor([0, query_len], dtype=torch.int32),
        torch.tensor([seq_len], dtype=torch.int32), scale, max_query_len=query_len,
        query_lens_cpu=(query_len,), seq_lens_cpu=(seq_len,),
    )  # fmt: skip
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_eligible_only_for_one_long_16_bit_chunk() -> None:
    q = torch.empty(2048, 4, 128, dtype=torch.bfloat16)
    cache = torch.empty(1, 16, 2, 128, dtype=torch.bfloat16)
    assert dense_prefill.eligible(q, cache, (2048,), (2048,))
    assert not dense_prefill.eligible(q, cache, (1024, 1024), (1024, 1024))  # two requests
    assert not dense_prefill.eligible(q[:100], cache, (100,), (5000,))  # short chunk
    assert not dense_prefill.eligible(q.float(), cache.float(), (2048,), (2048,))  # fp32
    assert not dense_prefill.eligible(q, cache, None, None)  # no host lengths
    # K and V gathered for every query head must fit MAX_GATHER_BYTES: 4 heads x 128 x 2 bytes x 2
    per_token = 4 * 128 * 2 * 2
    assert dense_prefill.eligible(q, cache, (2048,), (dense_prefill.MAX_GATHER_BYTES // per_token,))
    assert not dense_prefill.eligible(q, cache, (2048,), (dense_prefill.MAX_GATHER_BYTES // per_token + 1,))
    wide = torch.empty(2048, 4, 512, dtype=torch.bfloat16)
    assert not dense_prefill.eligible(wide, torch.empty(1, 16, 2, 512, dtype=torch.bfloat16), (2048,), (2048,))


# Quantized caches (kernels/kv_quant): keys and values in their own formats (k8v4: int8 keys, nvfp4 values).
KV_FORMATS = {"int8": ("int8", "int8"), "fp8": ("fp8", "fp8"), "nvfp4": ("nvfp4", "nvfp4"), "k8v4": ("int8", "nvfp4")}


@pytest.mark.parametrize("kv_format", list(KV_FORMATS))
@pytest.mark.parametrize("query_len, seq_len", [(40, 40), (40, 100)])
def test_quantized_caches_match_reference(kv_format, query_len, seq_len) -> None:
    """Dequantized while gathered, in q's dtype: with fp32 q, the same values the reference attends
    over; in chunks smaller than the context (DEQUANT_CHUNK_VALUES lowered)."""
    q, k_plain, v_plain, page_table = _case(query_len, seq_len, 6, 2, 64, torch.float32, 9)
    k_cache, v_cache = (quantize_rows(c, fmt) for c, fmt in zip((k_plain, v_plain), KV_FORMATS[kv_format]))
    scale = 64**-0.5
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dense_prefill, "DEQUANT_CHUNK_VALUES", 7 * 2 * 64)  # 7 tokens of 2 heads a chunk
        out = dense_prefill.paged_attention(q, k_cache, v_cache, page_table, scale, seq_len)
    expected = ref.paged_attention(
        q, k_cache, v_cache, page_table, torch.tensor([0, query_len], dtype=torch.int32),
        torch.tensor([seq_len], dtype=torch.int32), scale, max_query_len=query_len,
        query_lens_cpu=(query_len,), seq_lens_cpu=(seq_len,),
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_quantized_caches_are_eligible() -> None:
    q = torch.empty(2048, 4, 128, dtype=torch.bfloat16)
    plain = torch.empty(1, 16, 2, 128, dtype=torch.bfloat16)
    int8 = torch.empty(1, 16, 2, row_bytes("int8", 128), dtype=torch.int8)
    nvfp4 = torch.empty(1, 16, 2, row_bytes("nvfp4", 128), dtype=torch.uint8)
    assert dense_prefill.eligible(q, int8, (2048,), (2048,), nvfp4)
    assert dense_prefill.eligible(q, plain, (2048,), (2048,), plain)
    assert not dense_prefill.eligible(q, plain, (2048,), (2048,), plain.float())  # values of another dtype
    assert not dense_prefill.eligible(q.float(), int8, (2048,), (2048,), int8)  # fp32 q
