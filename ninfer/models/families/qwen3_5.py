"""The Qwen3.5 / 3.6 / 3.8 family (dense and MoE, VLM or text-only layout): config, presets, checkpoint rules.

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
from typing import TYPE_CHECKING, Any

import msgspec

from ninfer.contract.sampling import SamplingParams
from ninfer.models.config import ModelConfig
from ninfer.models.families.shared_fields import gated_delta_net_fields, moe_fields, mtp_fields
from ninfer.models.family import ModelFamily, SamplingPreset, WeightSlice

if TYPE_CHECKING:
    import torch  # annotations only: the API process reads families without torch

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


def config_fields(hf: dict[str, Any], rope: dict[str, Any], base_type: str) -> dict[str, Any]:
    """The Qwen3.5 hybrid trunk: Gated DeltaNet layers, experts (qwen3_5_moe) and the MTP head;
    q/k norms, gated attention output, zero-centred norms, interleaved MRoPE, and always-
    renormalised MoE top-k weights."""
    mrope_section = rope.get("mrope_section")
    return {
        **gated_delta_net_fields(hf),
        **moe_fields(hf),
        **mtp_fields(hf),
        "qk_norm": True,
        "attn_output_gate": bool(hf.get("attn_output_gate", True)),
        "zero_centered_norm": True,
        "mrope_section": tuple(mrope_section) if mrope_section else None,
        "mrope_interleaved": bool(rope.get("mrope_interleaved", True)),
        "norm_topk_prob": True,
    }


_THINKING = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=0.0)
_NON_THINKING = SamplingParams(temperature=0.7, top_p=0.80, top_k=20, min_p=0.0, presence_penalty=1.5)

FAMILY = ModelFamily(
    name="qwen3_5",
    model_types=("qwen3_5", "qwen3_5_moe"),
    model_class="ninfer.models.qwen3_5:Qwen3_5ForCausalLM",
    checkpoint_rule=convert,
    hybrid=True,
    config_fields=config_fields,
    # Qwen's published presets (temperature/top-p/top-k/min-p/presence penalty): the 27B uses
    # 1.0/0.95/20/0/0 when thinking and 0.7/0.80/20/0/1.5 when not; the 35B-A3B differs only in
    # its thinking presence penalty, 1.5. Qwen3.5, 3.6 and 3.8 share these shapes.
    sampling_presets=(
        SamplingPreset("Qwen3.6/3.8-27B", 5120, 64, 0, _THINKING, _NON_THINKING),
        SamplingPreset(
            "Qwen3.6-35B-A3B", 2048, 40, 256, msgspec.structs.replace(_THINKING, presence_penalty=1.5), _NON_THINKING
        ),
    ),
)
