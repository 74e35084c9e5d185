"""ModelConfig fields that several families read the same way from an HF config: Gated
DeltaNet layers, routed experts and the multi-token prediction head. Each family's
config_fields includes the ones its architecture has; the others keep ModelConfig's defaults."""

from __future__ import annotations

from typing import Any


def gated_delta_net_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "linear_conv_kernel_dim": int(hf.get("linear_conv_kernel_dim", 4)),
        "linear_key_head_dim": int(hf.get("linear_key_head_dim", 128)),
        "linear_value_head_dim": int(hf.get("linear_value_head_dim", 128)),
        "linear_num_key_heads": int(hf.get("linear_num_key_heads", 16)),
        "linear_num_value_heads": int(hf.get("linear_num_value_heads", 32)),
    }


def moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Routed experts (num_experts 0: a dense model), shared experts and which layers route."""
    return {
        "num_experts": int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": int(hf.get("moe_intermediate_size") or 0),
        "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size") or 0),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "decoder_sparse_step": int(hf.get("decoder_sparse_step", 1) or 1),
        "mlp_only_layers": tuple(hf.get("mlp_only_layers") or ()),
    }


def mtp_fields(hf: dict[str, Any]) -> dict[str, Any]:
    layers = hf.get("mtp_num_hidden_layers", hf.get("num_nextn_predict_layers", 0))
    return {"mtp_num_hidden_layers": int(layers or 0)}
