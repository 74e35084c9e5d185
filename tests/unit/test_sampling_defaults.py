"""SamplingDefaults: preset selection by architecture shape, and the override chain."""

from __future__ import annotations

from typing import Any

import pytest

from ninfer.contract.sampling import SamplingOverrides, SamplingParams
from ninfer.frontend.sampling_defaults import SamplingDefaults
from ninfer.models.config import ModelConfig

THINKING_27B = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=0.0)
NON_THINKING = SamplingParams(temperature=0.7, top_p=0.80, top_k=20, min_p=0.0, presence_penalty=1.5)
THINKING_35B = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=1.5)


def qwen_hf_config(hidden: int, layers: int, experts: int, model_type: str = "qwen3_5") -> dict[str, Any]:
    """An HF composite config of the Qwen3.5/3.6/3.8 shape (text trunk under text_config)."""
    text: dict[str, Any] = {
        "model_type": f"{model_type}_text",
        "vocab_size": 248320,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 24 if hidden == 5120 else 16,
        "num_key_value_heads": 4 if hidden == 5120 else 2,
        "head_dim": 256,
        "full_attention_interval": 4,
    }
    if experts:
        text.update(
            num_experts=experts,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
        )
    else:
        text["intermediate_size"] = 17408
    return {"model_type": model_type, "text_config": text, "_name_or_path": "some/renamed-model"}


CONFIG_27B = ModelConfig.from_hf(qwen_hf_config(5120, 64, 0))
CONFIG_35B = ModelConfig.from_hf(qwen_hf_config(2048, 40, 256, model_type="qwen3_5_moe"))


def test_registered_27b_shape_gets_its_presets() -> None:
    defaults = SamplingDefaults.for_model(CONFIG_27B, {"temperature": 0.1, "top_k": 3})
    assert defaults.preset(thinking=True) == THINKING_27B
    assert defaults.preset(thinking=False) == NON_THINKING
    assert defaults.resolve(thinking=True) == THINKING_27B  # generation defaults do not override a registered preset


def test_registered_35b_a3b_shape_differs_only_in_thinking_presence() -> None:
    defaults = SamplingDefaults.for_model(CONFIG_35B, None)
    assert defaults.resolve(thinking=True) == THINKING_35B
    assert defaults.resolve(thinking=False) == NON_THINKING
    for params in (defaults.thinking, defaults.non_thinking, SamplingDefaults.for_model(CONFIG_27B).thinking):
        assert params.frequency_penalty == 0.0


@pytest.mark.parametrize(
    "config",
    [
        CONFIG_27B.replace(num_hidden_layers=48),  # a different dense Qwen3.5 size
        CONFIG_27B.replace(family="llama", model_type="qwen3"),  # same numbers, another architecture
        CONFIG_35B.replace(num_experts=512),  # 35B-A3B width and depth, other expert count
        CONFIG_35B.replace(family="qwen3_next", num_hidden_layers=48, num_experts=512),  # Qwen3-Next-80B-A3B
        CONFIG_27B.replace(hidden_size=4096),
    ],
)
def test_other_shapes_are_not_registered_targets(config: ModelConfig) -> None:
    defaults = SamplingDefaults.for_model(config, None)
    assert defaults.name == "neutral"
    assert defaults.resolve(thinking=True) == defaults.resolve(thinking=False) == SamplingParams()


def test_generic_preset_reads_generation_defaults_for_both_modes() -> None:
    config = CONFIG_27B.replace(family="llama", model_type="qwen3")
    generation = {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 50,  # past the cap: clamps to 20
        "min_p": 0.02,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.1,  # no such engine parameter: not read
        "frequency_penalty": 0.9,  # not a generation-default key the preset reads
        "do_sample": True,
    }
    defaults = SamplingDefaults.for_model(config, generation)
    expected = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, min_p=0.02, presence_penalty=0.5)
    assert defaults.name == "generation defaults"
    assert defaults.resolve(thinking=True) == defaults.resolve(thinking=False) == expected
    partial = SamplingDefaults.for_model(config, {"temperature": 0.0, "top_k": 7})
    assert partial.resolve(thinking=True) == SamplingParams(temperature=0.0, top_k=7)


def test_unusable_generation_defaults_fall_back_to_neutral_and_are_reported() -> None:
    config = CONFIG_27B.replace(num_hidden_layers=48)
    defaults = SamplingDefaults.for_model(
        config, {"temperature": "hot", "top_p": 1.5, "top_k": True, "min_p": float("nan"), "presence_penalty": None}
    )
    assert defaults.resolve(thinking=True) == SamplingParams()
    ignored = set(defaults.describe()["ignored_generation_defaults"])
    assert ignored == {"temperature", "top_p", "top_k", "min_p", "presence_penalty"}


def test_precedence_preset_then_process_then_request_then_greedy() -> None:
    defaults = SamplingDefaults.for_model(CONFIG_27B)
    process = SamplingOverrides(temperature=0.5, top_k=5, frequency_penalty=0.2, seed=11)
    request = SamplingOverrides(temperature=1.2, min_p=0.1, seed=-3)

    only_process = defaults.resolve(thinking=False, process=process)
    assert only_process == SamplingParams(
        temperature=0.5, top_p=0.80, top_k=5, min_p=0.0, presence_penalty=1.5, frequency_penalty=0.2, seed=11
    )
    both = defaults.resolve(thinking=False, process=process, request=request)
    assert both == SamplingParams(
        temperature=1.2, top_p=0.80, top_k=5, min_p=0.1, presence_penalty=1.5, frequency_penalty=0.2, seed=-3
    )
    # --greedy comes last: it beats even a request's temperature and changes nothing else.
    greedy = defaults.resolve(thinking=False, process=process, request=request, greedy=True)
    assert greedy == SamplingParams(
        temperature=0.0, top_p=0.80, top_k=5, min_p=0.1, presence_penalty=1.5, frequency_penalty=0.2, seed=-3
    )
    assert greedy.is_greedy


def test_zero_valued_overrides_count_and_missing_seed_stays_unset() -> None:
    defaults = SamplingDefaults.for_model(CONFIG_35B)
    resolved = defaults.resolve(
        thinking=True,
        process=SamplingOverrides(presence_penalty=0.0, top_k=0),
        request=SamplingOverrides(temperature=0.0),
    )
    assert resolved == SamplingParams(temperature=0.0, top_p=0.95, top_k=0, min_p=0.0, presence_penalty=0.0)
    assert resolved.seed is None  # the engine assigns a fresh seed at admission


def test_describe_names_the_preset_and_its_values() -> None:
    described = SamplingDefaults.for_model(CONFIG_35B).describe()
    assert described["preset"] == "Qwen3.6-35B-A3B"
    assert described["thinking"]["presence_penalty"] == 1.5
    assert described["non_thinking"] == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "min_p": 0.0,
        "presence_penalty": 1.5,
        "frequency_penalty": 0.0,
    }
    assert SamplingDefaults.for_model(CONFIG_27B).describe()["preset"] == "Qwen3.6/3.8-27B"
