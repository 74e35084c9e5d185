"""The real Qwen3.5 text-trunk shapes the benchmark builds with random weights (no files)."""

from __future__ import annotations

from typing import Any

from ninfer.models.config import ModelConfig

_COMMON: dict[str, Any] = {
    "vocab_size": 248320,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "full_attention_interval": 4,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "dtype": "bfloat16",
}

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3.5-27B = Qwen3.6-27B = Qwen3.8-27B
    "27b": {
        **_COMMON,
        "model_type": "qwen3_5_text",
        "hidden_size": 5120,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "linear_num_value_heads": 48,
        "intermediate_size": 17408,
    },
    # Qwen3.5-35B-A3B = Qwen3.6-35B-A3B
    "35b-a3b": {
        **_COMMON,
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "linear_num_value_heads": 32,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    },
    # Small stand-in with the same structure, for CPU smoke runs of the harness itself; the real
    # vocabulary (from _COMMON), so its written checkpoint serves with the real tokenizer.
    "tiny": {
        **_COMMON,
        "model_type": "qwen3_5_text",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "intermediate_size": 256,
    },
}


# The vision tower of every Qwen3.5/3.6/3.8 VLM (out_hidden_size is the trunk's hidden size),
# and a small stand-in for the tiny shape.
VISION_SHAPES: dict[str, dict[str, Any]] = {
    "27b": {
        "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304,
        "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "num_position_embeddings": 2304, "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
    },
}
VISION_SHAPES["35b-a3b"] = VISION_SHAPES["27b"]
VISION_SHAPES["tiny"] = {
    **VISION_SHAPES["27b"], "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
    "num_position_embeddings": 16,
}


def vision_shape_config(name: str) -> dict[str, Any]:
    """The HF vision_config of shape `name`'s VLM, its merger emitting the trunk's hidden size."""
    if name not in VISION_SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose from {', '.join(VISION_SHAPES)}")
    return {**VISION_SHAPES[name], "out_hidden_size": SHAPES[name]["hidden_size"]}


def shape_config(name: str) -> tuple[dict[str, Any], ModelConfig]:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    hf = dict(SHAPES[name])
    return hf, ModelConfig.from_hf(hf, source=f"bench shape {name}")
