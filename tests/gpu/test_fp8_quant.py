"""Triton per-row FP8 quantization on the GPU vs ref.py (torch ops on the same device): the
same e4m3 bytes and scales, bit for bit, at the inputs of the prefill projections; and the
FP8 Linear's prefill product, which goes through it, against the dequantized weights.

The scale is amax times the fp32 reciprocal of 448 on both sides (ref.row_scales): on CUDA
torch divides by a Python scalar that way, which a division in the kernel did not match (the
first version of this kernel failed here on every shape)."""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.backend import fast_impl
from ninfer.kernels.fp8_quant import quantize_rows, ref
from ninfer.models.quant.fp8 import Fp8Linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Prefill inputs of the FP8 projections: hidden (27B 5120, 35B-A3B 2048), GDN / attention
# output (6144, 4096), MLP down (17408, 512); odd widths and row counts too.
SHAPES = [(8192, 5120), (8192, 2048), (4095, 6144), (1000, 17408), (17, 512), (33, 4100)]


def _activations(num_rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_rows, cols, device="cuda", generator=gen)
    x *= torch.logspace(-3, 3, num_rows, device="cuda")[:, None]
    x[1] = 0.0
    x[2, cols // 3] = 3e4
    return x.to(dtype)


def test_dispatch_takes_the_triton_kernel() -> None:
    assert fast_impl("ninfer.kernels.fp8_quant", "quantize_rows", torch.zeros(1, device="cuda")) is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_rows, cols", SHAPES)
def test_quantize_rows_equals_reference(num_rows: int, cols: int, dtype: torch.dtype) -> None:
    x = _activations(num_rows, cols, dtype, seed=num_rows + cols)
    q, scale = quantize_rows(x)
    q_ref, scale_ref = ref.quantize_rows(x)
    assert q.shape == q_ref.shape == (-(-num_rows // 16) * 16, cols)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_fp8_linear_prefill_through_the_kernel() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(2048, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8Linear.from_linear(linear)
    x = torch.randn(3000, 2048, device="cuda", dtype=torch.bfloat16)
    got = fp8(x)
    # The same product from the reference quantization, and the bf16 product of the dequantized weights.
    x_fp8, x_scale = ref.quantize_rows(x)
    want = torch._scaled_mm(x_fp8, fp8.weight.t(), scale_a=x_scale, scale_b=fp8.weight_scale.view(1, -1),
                            out_dtype=torch.bfloat16)[:3000]
    assert torch.equal(got, want)
    exact = x.float() @ fp8.dequantized(torch.float32).t()
    assert ((got.float() - exact).norm() / exact.norm()).item() < 0.05  # per-token e4m3 activations
