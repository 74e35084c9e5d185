"""Quantized KV rows (int8, fp8, nvfp4): the byte layout, each format's rounding bound, and the
paged attention reference and CPU version reading them as the dequantized values."""

from __future__ import annotations

import struct

import pytest
import torch

from ninfer.kernels.kv_quant import (
    FP8,
    INT8,
    NVFP4,
    check_head_dim,
    dequantize_rows,
    format_of,
    head_dim_of,
    quantize_rows,
    row_bytes,
)
from ninfer.kernels.paged_attention import cpu, ref
from ninfer.models.kv_cache import KVCache, kv_bytes_per_token

FORMATS = (INT8, FP8, NVFP4)


def _rows(num_rows: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_rows, head_dim, generator=generator)
    rows[0] = 0.0  # an all-zero row must survive its zero scale
    rows[1, 3] = 40.0  # an outlier channel, as keys have
    return rows


def test_row_widths_dtypes_and_the_scale_bytes() -> None:
    assert row_bytes(INT8, 256) == row_bytes(FP8, 256) == 260 and row_bytes(NVFP4, 256) == 148
    x = torch.tensor([[0.5, -1.0, 2.0, 126.0 / 63.5]])
    packed = quantize_rows(torch.nn.functional.pad(x, (0, 60)), INT8)
    assert packed.dtype == torch.int8 and format_of(packed) == INT8 and head_dim_of(packed) == 64
    raw = packed.view(torch.uint8)[0]
    (scale,) = struct.unpack("<f", bytes(raw[64:68].tolist()))
    assert scale == pytest.approx(2.0 / 127)  # the row's amax over 127, fp32 little-endian after the codes
    assert packed[0, :4].tolist() == [32, -64, 127, 126]  # round(x / scale), clamped to 127
    nvfp4 = quantize_rows(torch.ones(2, 64), NVFP4)
    assert nvfp4.dtype == torch.uint8 and nvfp4.shape == (2, 40) and head_dim_of(nvfp4) == 64
    # All values 1.0 = the row's max: code 7 (6.0) in both nibbles, block scales 448 (0x7E in e4m3).
    assert nvfp4[0, :32].tolist() == [0x77] * 32 and nvfp4[0, 32:36].tolist() == [0x7E] * 4
    assert check_head_dim(NVFP4, 80) is not None and check_head_dim(INT8, 80) is None
    assert check_head_dim(INT8, 30) is not None


@pytest.mark.parametrize("fmt, step", [(INT8, 1 / 127), (FP8, 1 / 8), (NVFP4, 1 / 3)])
def test_each_format_rounds_within_half_its_step(fmt: str, step: float) -> None:
    """int8: half a code of the row's max; fp8 e4m3: 3 mantissa bits, half of 2^-3 relative, or
    the subnormal step near zero; nvfp4: half of e2m1's widest gap (2 at 4..6), a sixth of each
    block's max, plus the block scale's own e4m3 rounding."""
    rows = _rows(64, 64)
    back = dequantize_rows(quantize_rows(rows, fmt), 64)
    assert torch.equal(back[0], torch.zeros(64))
    error = (back - rows).abs()
    if fmt == INT8:
        assert (error <= rows.abs().amax(-1, keepdim=True) * step / 2 * 1.0001).all()
    elif fmt == FP8:
        bound = torch.maximum(rows.abs() * step / 2, rows.abs().amax(-1, keepdim=True) / 448 * 2**-9)
        assert (error <= bound * 1.0001).all()
    else:
        block_max = rows.view(64, 4, 16).abs().amax(-1, keepdim=True)
        assert (error.view(64, 4, 16) <= block_max * (step / 2) * (1 + 2**-3) + 1e-6).all()
    assert error.max() > 0


def _cache_pair(fmt_k: str | None, fmt_v: str | None, values_k: torch.Tensor, values_v: torch.Tensor, slots):
    """Pages holding the given rows (stored by store_kv) in the given formats."""
    num_tokens, num_kv_heads, head_dim = values_k.shape

    def empty(fmt):
        width = head_dim if fmt is None else row_bytes(fmt, head_dim)
        dtype = torch.float32 if fmt is None else {INT8: torch.int8, FP8: torch.float8_e4m3fn, NVFP4: torch.uint8}[fmt]
        return torch.zeros(8, 16, num_kv_heads, width, dtype=dtype)

    k_cache, v_cache = empty(fmt_k), empty(fmt_v)
    ref.store_kv(values_k, values_v, k_cache, v_cache, slots)
    return k_cache, v_cache


@pytest.mark.parametrize("fmt_k, fmt_v", [(INT8, INT8), (FP8, FP8), (NVFP4, NVFP4), (INT8, NVFP4)])
def test_paged_attention_reads_quantized_caches_as_their_dequantized_values(fmt_k, fmt_v) -> None:
    generator = torch.Generator().manual_seed(1)
    seq_len, num_kv_heads, group, head_dim = 40, 2, 3, 64
    keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
    values = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
    pages = torch.tensor([5, 2, 7])  # non-contiguous on purpose
    positions = torch.arange(seq_len)
    slots = pages[positions // 16] * 16 + positions % 16
    k_cache, v_cache = _cache_pair(fmt_k, fmt_v, keys, values, slots)
    # The same attention over plain caches holding the dequantized rows.
    plain_k, plain_v = _cache_pair(None, None, dequantize_rows(quantize_rows(keys, fmt_k), head_dim),
                                   dequantize_rows(quantize_rows(values, fmt_v), head_dim), slots)
    page_table = pages.unsqueeze(0).to(torch.int32)
    for query_len in (1, 7):  # a decode row; a chunk over a cached prefix
        q = torch.randn(query_len, num_kv_heads * group, head_dim, generator=generator)
        lens = dict(max_query_len=query_len, query_lens_cpu=(query_len,), seq_lens_cpu=(seq_len,))
        args = (page_table, torch.tensor([0, query_len], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32), 0.125)
        expected = ref.paged_attention(q, plain_k, plain_v, *args, **lens)
        assert torch.allclose(ref.paged_attention(q, k_cache, v_cache, *args, **lens), expected, atol=1e-6)
        assert torch.allclose(cpu.paged_attention(q, k_cache, v_cache, *args, **lens), expected, atol=1e-5)


def test_cache_sizes_follow_each_format() -> None:
    for kv_dtype, (k_width, v_width) in {"bf16": (64, 64), "int8": (68, 68), "fp8": (68, 68),
                                         "nvfp4": (40, 40), "k8v4": (68, 40)}.items():
        cache = KVCache.allocate(3, 4, 16, 2, 64, torch.bfloat16, kv_dtype=kv_dtype)
        assert (cache.k.shape[-1], cache.v.shape[-1]) == (k_width, v_width)
        element = 2 if kv_dtype == "bf16" else 1
        assert cache.bytes_per_token == 3 * 2 * (k_width + v_width) * element
        assert cache.bytes_per_token == kv_bytes_per_token(3, 2, 64, 2, kv_dtype)
