"""The roofline's bytes per decode round against the models the bench actually builds: the
weights of every Linear (bf16, or e4m3 where quantize_fp8_ replaced it) and the experts one
token routes to, counted from the modules of the real 27B and 35B-A3B shapes (on the meta
device: no storage)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ninfer.bench.roofline import model_bytes
from ninfer.bench.shapes import shape_config
from ninfer.models.layers.moe import Experts
from ninfer.models.loader import build_model
from ninfer.models.quant.fp8 import Fp8Linear, quantize_fp8_
from ninfer.models.quant.fp8_experts import Fp8Experts


def _streamed_weight_bytes_at_batch_1(model: nn.Module, experts_per_token: int) -> int:
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
        elif isinstance(module, Fp8Linear):
            total += module.weight.numel() * module.weight.element_size()  # scales: under 0.1%
        elif isinstance(module, (Experts, Fp8Experts)):
            num_experts = module.gate_up_proj.shape[0]
            per_expert = (module.gate_up_proj.numel() + module.down_proj.numel()) // num_experts
            total += experts_per_token * per_expert * module.gate_up_proj.element_size()
    return total


@pytest.mark.parametrize("shape", ["27b", "35b-a3b"])
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_weight_bytes_per_round_match_the_built_model(shape: str, weights: str) -> None:
    _, config = shape_config(shape)
    model = build_model(config, torch.bfloat16, "meta")
    if weights == "fp8":
        assert quantize_fp8_(model) > 0
    experts_per_token = config.num_experts_per_tok if config.is_moe else 0
    counted = _streamed_weight_bytes_at_batch_1(model, experts_per_token)
    weight_bytes = 2.0 if weights == "bf16" else 1.0
    predicted = model_bytes(config, weight_bytes, kv_element_bytes=2, batch=1, expert_bytes=weight_bytes)
    assert predicted.weight_bytes_per_token == counted
