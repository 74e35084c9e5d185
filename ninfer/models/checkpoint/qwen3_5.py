"""Checkpoint rules for Qwen3.5 / 3.6 / 3.8 (dense and MoE, VLM or text-only layout).

- `model.language_model.X` (VLM checkpoints) and `model.X` (text-only) -> `model.X`
- `model.visual.*` -> nothing (the vision tower is a separate module)
- `mtp.*` -> the MTP head, or nothing when the config runs without it
- routed experts either fused 3-D (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
  [E, H, I], the hub trunk layout) or per expert (`experts.{e}.{gate,up,down}_proj.weight`:
  hub MTP layers and what transformers' save_pretrained writes) -> slices of the fused params
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from ninfer.models.config import ModelConfig
from ninfer.models.registry import WeightSlice

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def split_expert(name: str, tensor: torch.Tensor, config: ModelConfig) -> list[WeightSlice] | None:
    """A per-expert projection as its slice of the fused expert params; None if `name` is not one."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, proj = match["prefix"], int(match["expert"]), match["proj"]
    intermediate = config.moe_intermediate_size
    if proj == "down":
        return [(f"{prefix}.down_proj", expert, tensor)]
    rows = slice(0, intermediate) if proj == "gate" else slice(intermediate, 2 * intermediate)
    return [(f"{prefix}.gate_up_proj", (expert, rows), tensor)]


def trunk_name(name: str) -> str | None:
    """Our parameter name for a stored name, or None when we do not load it (vision, disabled MTP)."""
    if name.startswith("model.visual.") or name.startswith("visual."):
        return None
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name


def convert(name: str, tensor: torch.Tensor, config: ModelConfig) -> Iterator[WeightSlice]:
    target = trunk_name(name)
    if target is None:
        return
    if target.startswith("mtp.") and not config.mtp_num_hidden_layers:
        return
    expert_slices = split_expert(target, tensor, config)
    if expert_slices is not None:
        yield from expert_slices
        return
    yield target, None, tensor
