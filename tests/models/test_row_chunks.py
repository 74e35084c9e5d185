"""Quantization a chunk of rows at a time (models/quant/row_chunks.py): the same bits as the whole
weight quantized at once, for every module that quantizes through it, and a workspace that stays
within its stated bound while quantizing the weight at once does not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ninfer.kernels.fp8_quant.ref import quantize_rows
from ninfer.kernels.gemv.ref import quantize_blocks
from ninfer.kernels.nvfp4_gemv import quantize_nvfp4
from ninfer.models.layers.moe import Experts
from ninfer.models.quant import row_chunks
from ninfer.models.quant.fp8 import Fp8Linear, quantize_per_channel
from ninfer.models.quant.fp8_experts import Fp8Experts
from ninfer.models.quant.nvfp4 import Nvfp4Linear
from ninfer.models.quant.row_chunks import quantize_rows_into, workspace_bytes
from tests.models.allocation_peak import allocation_peak

# 3 rows of 96 and then some: chunks end mid-way between the rows' natural groupings (16, 128).
SMALL_CHUNK = 3 * 96 + 40


def _weight(rows: int, columns: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=gen) * columns**-0.5
    weight[3] = 0.0  # an all-zero row takes the smallest scale
    weight[5, 7] = 40.0  # an outlier sets its row's scale
    return weight.to(dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def _same(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(row_chunks, "CHUNK_ELEMENTS", SMALL_CHUNK)


def test_modules_quantized_in_chunks_equal_the_whole_weight_quantized(small_chunks) -> None:
    linear = nn.Linear(96, 40, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(_weight(40, 96, seed=1))
    fp8 = Fp8Linear.from_linear(linear)
    _same((fp8.weight, fp8.weight_scale), quantize_per_channel(linear.weight))
    assert fp8.bias is not None and torch.equal(fp8.bias, linear.bias)
    nvfp4 = Nvfp4Linear.from_linear(linear)
    _same((nvfp4.weight, nvfp4.block_scale, nvfp4.row_scale), quantize_nvfp4(linear.weight))

    experts = Experts(3, 96, 20).to(torch.bfloat16)  # gate_up [3, 40, 96], down [3, 96, 20]
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.stack([_weight(40, 96, seed=e) for e in range(3)]))
        experts.down_proj.copy_(torch.stack([_weight(96, 20, seed=10 + e) for e in range(3)]))
    fp8_experts = Fp8Experts.from_experts(experts)
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(experts, name)
        codes, scales = quantize_rows(weight.reshape(-1, weight.shape[-1]), row_multiple=1)
        expected = (codes.view(weight.shape), scales.view(weight.shape[:2]))
        _same((getattr(fp8_experts, name), fp8_experts.scale_of(name)), expected)


def test_writes_into_rows_round_to_the_given_dtype_first(small_chunks) -> None:
    """Row blocks (one scale per row and 128 columns) are row-local too; a weight stored in fp32
    for a bf16 model is rounded to bf16 before it is quantized, as loading it would."""
    weight = _weight(40, 300, seed=2, dtype=torch.float32)
    codes = torch.empty(60, 300, dtype=torch.float8_e4m3fn)
    scales = torch.empty(60, 3)
    quantize_rows_into(weight, (codes[10:50], scales[10:50]), lambda rows: quantize_blocks(rows, 1), torch.bfloat16)
    _same((codes[10:50], scales[10:50]), quantize_blocks(weight.bfloat16(), 1))


def test_a_row_longer_than_a_chunk_is_its_own_chunk(monkeypatch) -> None:
    monkeypatch.setattr(row_chunks, "CHUNK_ELEMENTS", 50)
    weight = _weight(8, 96, seed=3)
    outputs = (torch.empty(8, 48, dtype=torch.uint8), torch.empty(8, 6, dtype=torch.float8_e4m3fn), torch.empty(8))
    quantize_rows_into(weight, outputs, quantize_nvfp4)
    _same(outputs, quantize_nvfp4(weight))
    assert workspace_bytes(largest_row=96) == 96 * row_chunks.WORKSPACE_BYTES_PER_ELEMENT


def test_chunked_nvfp4_quantization_stays_within_its_workspace_bound(small_chunks) -> None:
    """Measured on the CPU allocator: beyond its outputs, quantizing a chunk at a time holds at most
    workspace_bytes(); the same weight quantized at once holds ~180 bytes a weight, far more."""
    weight = _weight(64, 96, seed=4)
    outputs = (torch.empty(64, 48, dtype=torch.uint8), torch.empty(64, 6, dtype=torch.float8_e4m3fn), torch.empty(64))
    _, chunked = allocation_peak(lambda: quantize_rows_into(weight, outputs, quantize_nvfp4))
    _, whole = allocation_peak(lambda: quantize_nvfp4(weight))
    assert 0 < chunked <= workspace_bytes(largest_row=96)
    assert whole > 4 * workspace_bytes(largest_row=96)
