"""--tensor-parallel's validation: values other than 1, 2, 4, 8; models whose heads or intermediate
sizes the ranks do not divide; more ranks than devices. Each is one error naming
--tensor-parallel, before any rank starts; speculative decoding, the vision tower, quantized
checkpoints and containers pass."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ninfer.cli import serve_main
from ninfer.config import ConfigValueError, EngineConfig
from ninfer.engine.startup_checks import check_tensor_parallel, resolve_device
from ninfer.models.config import ModelConfig

CONFIG = ModelConfig(
    model_type="qwen3_5_text", family="qwen3_5", vocab_size=64, hidden_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
    layer_types=("linear_attention", "full_attention"), linear_num_key_heads=4, linear_num_value_heads=8,
)  # fmt: skip


def artifact(**changes) -> SimpleNamespace:
    return SimpleNamespace(**{"path": Path("/models/tiny"), "config": CONFIG, "runtime_loader": None,
                              "fp8_weights": {}, "nvfp4_weights": {}, **changes})  # fmt: skip


@pytest.mark.parametrize("size", [0, 3, 6, 16])
def test_only_1_2_4_and_8_ranks(size):
    with pytest.raises(ConfigValueError, match=r"^--tensor-parallel must be 1, 2, 4 or 8$"):
        EngineConfig(tensor_parallel=size)


def test_the_command_line_names_the_option(capsys):
    assert serve_main(["/models/tiny", "--tensor-parallel", "3"]) == 2
    assert capsys.readouterr().err == "ninfer-serve: error: --tensor-parallel must be 1, 2, 4 or 8\n"


@pytest.mark.parametrize(
    "engine, changes, message",
    [
        ({"tensor_parallel": 8}, {},
         "--tensor-parallel 8: /models/tiny does not split over 8 ranks: its attention heads (4) cannot be divided among 8 ranks"),
    ],
)  # fmt: skip
def test_what_the_ranks_cannot_run_is_refused(engine, changes, message):
    config = EngineConfig(**{"tensor_parallel": 2, **engine})
    with pytest.raises(ConfigValueError) as refused:
        check_tensor_parallel(artifact(**changes), config)
    assert str(refused.value) == message


@pytest.mark.parametrize(
    "engine, changes",
    [({"spec": "mtp", "draft_tokens": 2}, {}), ({"spec": "dflash", "draft_tokens": 2}, {}),
     ({"vision": True}, {}), ({}, {"fp8_weights": {"w": (128, 64)}}), ({}, {"nvfp4_weights": {"w": (128, 64)}}),
     ({}, {"runtime_loader": object()})],
)  # fmt: skip
def test_speculation_vision_quantized_checkpoints_and_containers_split(engine, changes):
    check_tensor_parallel(artifact(**changes), EngineConfig(**{"tensor_parallel": 2, **engine}))


def test_one_rank_checks_nothing():
    check_tensor_parallel(artifact(runtime_loader=object()), EngineConfig(vision=True))


def test_more_ranks_than_devices_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device(0, 4) == "cuda:0"
    with pytest.raises(ConfigValueError, match=r"^--tensor-parallel 4: needs 4 CUDA devices from --device 1 on; 3 visible$"):
        resolve_device(1, 4)
