"""The benchmark's random weights made one tensor at a time (random_tensors) load into the model
fill_random_ fills, bit for bit, and quantized as they load into the model quantize_fp8_ /
quantize_nvfp4_ make of it: `ninfer bench --weights fp8|nvfp4` measures the same model as before
without ever holding it whole in bf16."""

from __future__ import annotations

import pytest
import torch

from ninfer.bench.random_weights import fill_random_, random_tensors, stored_parameters
from ninfer.bench.shapes import SHAPES
from ninfer.models.config import ModelConfig
from ninfer.models.loader import QUANTIZE_AT_LOAD, build_model, load_weights
from tests.models.test_quantize_at_load import assert_same_model

# The tiny shape smaller still (a few seconds of NVFP4 quantization on the CPU), with an MTP head.
TINY = {**SHAPES["tiny"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "mtp_num_hidden_layers": 1}
TINY_MOE = {
    **TINY, "model_type": "qwen3_5_moe_text", "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
}


@pytest.mark.parametrize(
    "hf_config, quantize",
    [(TINY, None), (TINY, "fp8"), (TINY, "nvfp4"), (TINY_MOE, "fp8")],  # fp8 quantizes the routed experts
    ids=["dense-bf16", "dense-fp8", "dense-nvfp4", "moe-fp8"],
)
def test_random_tensors_load_into_the_filled_model(hf_config: dict, quantize: str | None) -> None:
    config = ModelConfig.from_hf(hf_config, source="test shape")
    expected = build_model(config, torch.bfloat16)
    fill_random_(stored_parameters(expected), seed=3)
    if quantize is not None:
        QUANTIZE_AT_LOAD[quantize](expected)
    ours = build_model(config, torch.bfloat16, quantize=quantize)
    load_weights(ours, random_tensors(config, torch.bfloat16, "cpu", seed=3), progress=False, dtype=torch.bfloat16)
    assert_same_model(ours, expected)
