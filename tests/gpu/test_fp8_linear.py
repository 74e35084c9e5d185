"""Fp8Linear on the GPU: the GEMV kernel (<= 16 rows) and torch._scaled_mm (prefill rows)
against the dequantized weight in fp32, at a real 27B projection shape."""

from __future__ import annotations

import pytest
import torch

from ninfer.models.quant.fp8 import Fp8Linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("num_rows", [1, 8, 16, 17, 512])
def test_fp8_linear_matches_dequantized_reference(num_rows: int) -> None:
    gen = torch.Generator("cuda").manual_seed(num_rows)
    linear = torch.nn.Linear(5120, 6144, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(6144, 5120, device="cuda", generator=gen) * 5120**-0.5)
    fp8 = Fp8Linear.from_linear(linear)
    x = torch.randn(num_rows, 5120, device="cuda", generator=gen).bfloat16()
    expected = x.float() @ fp8.dequantized(torch.float32).T
    out = fp8(x)
    assert out.dtype == torch.bfloat16 and out.shape == (num_rows, 6144)
    # GEMV: bf16 output rounding. _scaled_mm also quantizes x per row to e4m3 (2^-4 relative).
    tolerance = 2**-7 if num_rows <= 16 else 2**-3
    error = (out.float() - expected).abs().max().item()
    assert error <= tolerance * expected.abs().max().item(), error
