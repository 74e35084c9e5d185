"""The family registry: each family module declares its model types, model class, checkpoint rule
and presets, and ModelConfig reads family quirks only through it."""

from __future__ import annotations

import pytest

from ninfer.models.causal_lm import CausalLM
from ninfer.models.config import ConfigError, ModelConfig
from ninfer.models.registry import families, family_for_model_type, model_class, sampling_preset_for

BASE = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}


def test_every_family_is_complete_and_model_types_are_unique():
    seen: dict[str, str] = {}
    for family in families():
        for model_type in family.model_types:
            assert model_type not in seen, (model_type, seen.get(model_type), family.name)
            seen[model_type] = family.name
        config = ModelConfig.from_hf({**BASE, "model_type": family.model_types[0]})
        assert config.family == family.name and config.is_hybrid == family.hybrid
        assert issubclass(model_class(config), CausalLM)
        assert callable(family.checkpoint_rule)


def test_vlm_trunks_and_unknown_types():
    assert family_for_model_type("qwen3_5_moe_text").name == "qwen3_5"
    assert family_for_model_type("mistral") is None
    with pytest.raises(ConfigError, match="unsupported model_type 'mistral'.*qwen3_5"):
        ModelConfig.from_hf({**BASE, "model_type": "mistral"})


def test_family_quirks_come_from_the_family_module():
    qwen2 = ModelConfig.from_hf({**BASE, "model_type": "qwen2"})
    qwen3 = ModelConfig.from_hf({**BASE, "model_type": "qwen3"})
    llama = ModelConfig.from_hf({**BASE, "model_type": "llama", "attention_bias": True})
    hybrid = ModelConfig.from_hf({**BASE, "model_type": "qwen3_5_text", "norm_topk_prob": False})
    assert (qwen2.attention_bias, qwen2.qk_norm, qwen3.qk_norm) == (True, False, True)
    assert (llama.attention_bias, llama.attention_output_bias) == (True, True)
    assert hybrid.zero_centered_norm and hybrid.attn_output_gate and hybrid.norm_topk_prob
    with pytest.raises(ConfigError, match="qwen3_moe config without num_experts"):
        ModelConfig.from_hf({**BASE, "model_type": "qwen3_moe"})


def test_presets_match_registered_shapes_only():
    dense = {**BASE, "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64}
    assert sampling_preset_for(ModelConfig.from_hf(dense)).name == "Qwen3.6/3.8-27B"
    assert sampling_preset_for(ModelConfig.from_hf({**dense, "model_type": "qwen3"})) is None  # another family
    assert sampling_preset_for(ModelConfig.from_hf({**dense, "num_hidden_layers": 48})) is None
