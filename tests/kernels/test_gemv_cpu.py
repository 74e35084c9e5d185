"""CPU GEMV for float16 weights with float32 activations (ninfer/kernels/gemv/cpu.py) vs ref.py,
and the routes of linear_half_weight (decode rows on the GEMV, prefill on a widened weight).

The fast path rounds the activations and the product to float16 (2^-11 relative each, with
fp32 accumulation), so it agrees with the reference's exact fp32 product to a few float16
steps of the output's scale.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels import gemv as dispatch
from ninfer.kernels.gemv import cpu, ref


def _operands(rows: int, out_features: int, in_features: int, seed: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    weight = (torch.randn(out_features, in_features, generator=gen) * in_features**-0.5).half()
    b = torch.randn(out_features, generator=gen) if bias else None
    return x, weight, b


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (257, 576), (1, 1536)])
def test_half_weight_matches_reference(rows, bias, out_features, in_features) -> None:
    x, weight, b = _operands(rows, out_features, in_features, rows * 7 + in_features, bias)
    out, expected = cpu.gemv(x, weight, None, b), ref.gemv(x, weight, None, b)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    scale = expected.abs().max().item()
    torch.testing.assert_close(out, expected, atol=4e-3 * scale, rtol=0)


def test_out_of_float16_range_falls_back_to_the_reference() -> None:
    x, weight, _ = _operands(1, 32, 64, 1, False)
    x[0, 3] = 1e6  # beyond float16's 65504 on the way in
    torch.testing.assert_close(cpu.gemv(x, weight), ref.gemv(x, weight), atol=0, rtol=0)
    x, weight, _ = _operands(1, 32, 64, 2, False)
    out = cpu.gemv(x * 3e3, weight * 50)  # inputs in range, products past it
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref.gemv(x * 3e3, weight * 50), atol=0, rtol=0)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_other_weights_are_the_reference(weight_dtype) -> None:
    x, weight, b = _operands(2, 48, 32, 4, True)
    weight = weight.to(weight_dtype)
    x = x.to(weight_dtype)
    torch.testing.assert_close(cpu.gemv(x, weight, None, b), ref.gemv(x, weight, None, b), atol=0, rtol=0)


def test_linear_half_weight_routes_by_rows(monkeypatch) -> None:
    x, weight, b = _operands(dispatch.HALF_WEIGHT_GEMV_MAX_ROWS + 3, 40, 24, 5, True)
    calls = []
    real = cpu.gemv
    monkeypatch.setattr(cpu, "gemv", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    decode = dispatch.linear_half_weight(x[:1], weight, b)
    assert calls == [1]
    torch.testing.assert_close(decode, ref.gemv(x[:1], weight, None, b), atol=4e-3 * decode.abs().max().item(), rtol=0)
    # Prefill rows: the widened weight's exact fp32 product (the GEMV is not called).
    prefill = dispatch.linear_half_weight(x.view(1, *x.shape), weight, b)
    assert calls == [1] and prefill.shape == (1, x.shape[0], 40)
    torch.testing.assert_close(prefill[0], ref.gemv(x, weight, None, b), atol=1e-5, rtol=1e-5)


def test_ref_is_forced_by_the_environment(monkeypatch) -> None:
    x, weight, _ = _operands(1, 16, 16, 6, False)
    monkeypatch.setenv("NINFER_KERNELS", "ref")
    monkeypatch.setattr(cpu, "gemv", lambda *a: pytest.fail("the CPU path ran under NINFER_KERNELS=ref"))
    torch.testing.assert_close(dispatch.gemv(x, weight), ref.gemv(x, weight), atol=0, rtol=0)
