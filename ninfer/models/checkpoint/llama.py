"""Checkpoint rule for the llama family (Llama, Qwen2, Qwen3, Qwen3-MoE).

Names already match the model except Qwen3-MoE experts, which HF checkpoints store one
tensor per expert; our model keeps them fused ([E, 2I, H] gate rows then up rows, and
[E, H, I]), so each expert tensor becomes a slice write. Fused names (as written by
transformers 5.x) pass through unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from ninfer.models.config import ModelConfig
from ninfer.models.registry import WeightSlice

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
