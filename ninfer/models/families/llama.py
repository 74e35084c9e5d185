"""The llama family (Llama, Qwen2, Qwen3, Qwen3-MoE): its config quirks and checkpoint rule.

Names already match the model except Qwen3-MoE experts, which HF checkpoints store one
tensor per expert; our model keeps them fused ([E, 2I, H] gate rows then up rows, and
[E, H, I]), so each expert tensor becomes a slice write. Fused names (as written by
transformers 5.x) pass through unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ninfer.models.config import ConfigError, ModelConfig
from ninfer.models.families.shared_fields import moe_fields, mtp_fields
from ninfer.models.family import ModelFamily, WeightSlice

if TYPE_CHECKING:
    import torch  # annotations only: the API process reads families without torch

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Buffers some exporters save; we recompute them.
_SKIPPED_SUFFIXES = (".rotary_emb.inv_freq",)


def convert(name: str, tensor: torch.Tensor, config: ModelConfig) -> Iterator[WeightSlice]:
    if name.endswith(_SKIPPED_SUFFIXES):
        return
    expert = _EXPERT.match(name)
    if expert is None:
        yield name, None, tensor
        return
    prefix, expert_id, projection = expert.group(1), int(expert.group(2)), expert.group(3)
    intermediate = config.moe_intermediate_size
    if projection == "down_proj":
        yield f"{prefix}.down_proj", expert_id, tensor
    elif projection == "gate_proj":
        yield f"{prefix}.gate_up_proj", (expert_id, slice(0, intermediate)), tensor
    else:
        yield f"{prefix}.gate_up_proj", (expert_id, slice(intermediate, 2 * intermediate)), tensor


def _config_fields(hf: dict[str, Any], rope: dict[str, Any], base_type: str) -> dict[str, Any]:
    experts = moe_fields(hf)  # Qwen3-MoE's (none in the others' configs)
    if base_type == "qwen3_moe" and not experts["num_experts"]:
        raise ConfigError("qwen3_moe config without num_experts")
    attention_bias = bool(hf.get("attention_bias") or False)
    return {
        **experts,
        # No model of this family has an MTP head; a declared one is still read so that the
        # artifact says it loads without it (hf_directory) instead of dropping it unseen.
        **mtp_fields(hf),
        # transformers' Qwen2 always has q/k/v biases, whatever the config says.
        "attention_bias": True if base_type == "qwen2" else attention_bias,
        "attention_output_bias": base_type == "llama" and attention_bias,  # Llama's also covers o_proj
        "qk_norm": base_type in ("qwen3", "qwen3_moe"),
    }


FAMILY = ModelFamily(
    name="llama",
    model_types=("llama", "qwen2", "qwen3", "qwen3_moe"),
    model_class="ninfer.models.llama:LlamaForCausalLM",
    checkpoint_rule=convert,
    config_fields=_config_fields,
)
