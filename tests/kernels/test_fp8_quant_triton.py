"""Our Triton per-row FP8 quantization under Triton's CPU interpreter vs ref.py: the same
e4m3 bytes and the same scales, bit for bit (the compiled kernel: tests/gpu/test_fp8_quant.py).
The interpreter is given the GPU's fp32 -> e4m3 rounding (its own drops the carry into the
exponent)."""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.fp8_quant import ref
from tests.kernels.interpreter import (  # noqa: F401 (fixtures)
    cpu_interpreter,
    fp8e4nv_round_to_nearest_even,
    interpreted,
)

pytestmark = pytest.mark.usefixtures("fp8e4nv_round_to_nearest_even")

fast = interpreted("ninfer.kernels.fp8_quant.triton")


def _activations(num_rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, cols, generator=gen) * torch.logspace(-3, 3, num_rows)[:, None]
    if num_rows > 2:
        x[1] = 0.0  # an all-zero row: the minimum amax
        x[2, cols // 2] = 1e4  # one outlier sets its row's scale
    return x.to(dtype)


def _assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, scale), (q_ref, scale_ref) = got, want
    assert q.shape == q_ref.shape and q.dtype == q_ref.dtype and scale.shape == scale_ref.shape
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_rows, cols", [(1, 5), (17, 300), (40, 2048), (3, 5000)])
def test_quantize_rows_matches_reference(dtype: torch.dtype, num_rows: int, cols: int) -> None:
    x = _activations(num_rows, cols, dtype, seed=num_rows * cols)
    _assert_same(fast.quantize_rows(x), ref.quantize_rows(x))


def test_padding_rows_and_strided_input() -> None:
    x = _activations(20, 600, torch.bfloat16, seed=3)[:, 50:550]  # rows 600 apart, 500 wide
    q, scale = fast.quantize_rows(x, row_multiple=16)
    assert q.shape == (32, 500)
    assert torch.equal(q[20:].view(torch.uint8), torch.zeros(12, 500, dtype=torch.uint8))
    assert torch.equal(scale[20:], torch.ones(12, 1))
    _assert_same((q, scale), ref.quantize_rows(x, row_multiple=16))


def test_rejects_other_ranks() -> None:
    with pytest.raises(ValueError):
        fast.quantize_rows(torch.zeros(2, 3, 4))
