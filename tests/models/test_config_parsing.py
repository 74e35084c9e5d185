"""ModelConfig.from_hf on the configs of every family and layout we serve: the parsed dataclass
must equal the one recorded in config_parsing_expected.json (common fields parsed by from_hf,
Gated DeltaNet, MoE and MTP fields by the family modules)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ninfer.models.config import ModelConfig

EXPECTED = Path(__file__).with_name("config_parsing_expected.json")

_QWEN3_5_TEXT = {
    "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1], "mrope_interleaved": True,
    },
    "tie_word_embeddings": True, "eos_token_id": 248046, "pad_token_id": 248044,
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "attention_bias": True, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": [2, 3],
}
_QWEN3_NEXT = {
    "model_type": "qwen3_next", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "full_attention_interval": 2, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "partial_rotary_factor": 0.25, "rope_theta": 10000.0, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "norm_topk_prob": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "float32",
}

CASES: dict[str, dict] = {
    "qwen3_5_text": {**_QWEN3_5_TEXT, "model_type": "qwen3_5_text"},
    "qwen3_5_text_mtp": {**_QWEN3_5_TEXT, "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1},
    "qwen3_5_vlm": {
        "model_type": "qwen3_5", "tie_word_embeddings": True, "eos_token_id": 248046,
        "text_config": {**_QWEN3_5_TEXT, "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1,
                        "tie_word_embeddings": None, "eos_token_id": None},
        "vision_config": {"depth": 1, "hidden_size": 32, "out_hidden_size": 64},
    },
    "qwen3_5_vlm_text_type_implied": {
        "model_type": "qwen3_5", "dtype": "bfloat16", "text_config": {k: v for k, v in _QWEN3_5_TEXT.items()},
    },
    "qwen3_5_moe_text_mtp": {**_QWEN3_5_TEXT, **_MOE, "model_type": "qwen3_5_moe_text", "mtp_num_hidden_layers": 1,
                             "norm_topk_prob": False},
    "qwen3_5_moe_vlm": {
        "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
        "text_config": {**_QWEN3_5_TEXT, **_MOE, "model_type": "qwen3_5_moe_text", "intermediate_size": None},
    },
    "qwen3_5_interval_layout": {
        **{k: v for k, v in _QWEN3_5_TEXT.items() if k != "layer_types"}, "model_type": "qwen3_5_text",
        "num_hidden_layers": 8, "full_attention_interval": 4, "dtype": "bfloat16",
    },
    "qwen3_5_default_gdn_heads": {
        "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64,
    },
    "qwen3_next_moe": _QWEN3_NEXT,
    "qwen3_next_dense": {**{k: v for k, v in _QWEN3_NEXT.items() if k not in _MOE}, "mtp_num_hidden_layers": 1},
    "llama": _LLAMA,
    "llama_rope_scaling_mtp": {
        **_LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "rope_theta": 500000.0, "mlp_bias": True, "mtp_num_hidden_layers": 1,
    },
    "llama_nextn_alias": {**_LLAMA, "num_nextn_predict_layers": 2, "tie_word_embeddings": True},
    "qwen2": {**_LLAMA, "model_type": "qwen2", "attention_bias": False, "rope_theta": 1000000.0},
    "qwen3_drafter": {
        **_LLAMA, "model_type": "qwen3", "head_dim": 16, "layer_types": ["full_attention", "full_attention"],
        "dflash_config": {"block_size": 16, "mask_token_id": 248070, "target_layer_ids": [2, 0]},
    },
    "qwen3_moe": {
        **_LLAMA, "model_type": "qwen3_moe", "attention_bias": False, "num_hidden_layers": 3, "head_dim": 16,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1],
        "norm_topk_prob": False, "decoder_sparse_step": 2, "intermediate_size": None,
    },
    "qwen3_moe_local_experts": {
        **_LLAMA, "model_type": "qwen3_moe", "num_local_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    },
}


def parsed(hf: dict) -> dict:
    """A parsed config as JSON holds it (tuples as lists)."""
    return json.loads(json.dumps(dataclasses.asdict(ModelConfig.from_hf(hf, source=hf["model_type"]))))


@pytest.mark.parametrize("name", sorted(CASES))
def test_parsed_config_is_the_recorded_one(name: str) -> None:
    assert parsed(CASES[name]) == json.loads(EXPECTED.read_text())[name]


def test_every_recorded_config_is_a_case() -> None:
    assert sorted(json.loads(EXPECTED.read_text())) == sorted(CASES)
