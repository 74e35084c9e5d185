"""Fp8Linear (per-channel and 128x128 block scales) and quantize_fp8_ on the CPU paths.

The GPU paths (GEMV kernel at <= 16 rows, torch._scaled_mm above) are checked against the
same dequantized reference in tests/gpu/test_fp8_linear.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ninfer.models.layers.linear import Linear, PackedLinear
from ninfer.models.quant.fp8 import FP8, Fp8Linear, quantize_fp8_


def _linear(out_features: int, in_features: int, seed: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=True)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen) * in_features**-0.5)
        layer.bias.copy_(torch.randn(out_features, generator=gen) * 0.1)
    return layer


@pytest.mark.parametrize("num_rows", [1, 5, 16, 17, 40])  # both sides of gemv.MAX_ROWS
def test_per_channel_forward_equals_dequantized_linear(num_rows: int) -> None:
    layer = _linear(96, 200, seed=num_rows)
    fp8 = Fp8Linear.from_linear(layer)
    assert fp8.weight.dtype == FP8 and fp8.weight_scale.shape == (96,)
    x = torch.randn(num_rows, 200, generator=torch.Generator().manual_seed(1))
    expected = F.linear(x, fp8.dequantized(torch.float32), fp8.bias)
    torch.testing.assert_close(fp8(x), expected, atol=1e-5, rtol=1e-5)
    # e4m3 keeps 3 mantissa bits: each weight within 2^-4 of its value relative to its row's max.
    error = (fp8.dequantized(torch.float32) - layer.weight).abs().amax(dim=1)
    assert (error <= layer.weight.abs().amax(dim=1) * 2**-4).all()


def test_block_scaled_dequantization_and_forward() -> None:
    out_features, in_features = 200, 300  # neither a multiple of the 128 block
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(out_features, in_features, generator=gen) * 50).clamp(-448, 448).to(FP8)
    scale = torch.rand(2, 3, generator=gen) + 0.01
    fp8 = Fp8Linear(weight, scale, None)
    expected_weight = torch.empty(out_features, in_features)
    for row in range(out_features):
        for col in range(in_features):
            expected_weight[row, col] = weight[row, col].float() * scale[row // 128, col // 128]
    torch.testing.assert_close(fp8.dequantized(torch.float32), expected_weight, atol=0, rtol=0)
    for num_rows in (3, 33):
        x = torch.randn(num_rows, in_features, generator=gen)
        torch.testing.assert_close(fp8(x), x @ expected_weight.T, atol=1e-4, rtol=1e-5)


def test_quantize_replaces_linears_but_not_lm_head() -> None:
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.gate_up_proj = PackedLinear(32, {"gate_proj": 64, "up_proj": 64})
    model.mlp.down_proj = Linear(64, 32, bias=False)
    model.router = Linear(32, 8, bias=False)  # fewer than 16 outputs stays as is
    model.lm_head = Linear(32, 100, bias=False)
    assert quantize_fp8_(model) == 2
    assert isinstance(model.mlp.gate_up_proj, Fp8Linear) and isinstance(model.mlp.down_proj, Fp8Linear)
    assert type(model.router) is Linear and type(model.lm_head) is Linear


def test_quantize_keeps_moe_routers_bf16_but_not_similar_names() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].mlp = nn.Module()
    model.layers[0].mlp.gate = Linear(32, 256, bias=False)  # the MoE router
    model.layers[0].mlp.gate_proj = Linear(32, 64, bias=False)
    model.layers[0].mlp.shared_expert = nn.Module()
    model.layers[0].mlp.shared_expert.gate_proj = Linear(32, 64, bias=False)
    assert quantize_fp8_(model) == 2
    assert type(model.layers[0].mlp.gate) is Linear
    assert isinstance(model.layers[0].mlp.gate_proj, Fp8Linear)
    assert isinstance(model.layers[0].mlp.shared_expert.gate_proj, Fp8Linear)
