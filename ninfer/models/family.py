"""ModelFamily: what NInfer knows about one architecture family, declared in its family module.

A family module (models/families/<name>.py) says which HF model_types it serves, which
ModelConfig fields its configs set beyond the common reading (the parts its architecture
has: Gated DeltaNet layers, routed experts, an MTP head) or differently, how its checkpoint
names map onto the model's parameters, and the sampling presets of its registered shapes.
The model itself is a plain nn.Module in models/<name>.py. Adding a family touches those two
files and the list in registry.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ninfer.contract.sampling import SamplingParams

if TYPE_CHECKING:
    # Annotations only: the API process reads families (configs, sampling presets) without torch.
    import torch

    from ninfer.models.config import ModelConfig

# A checkpoint rule maps one stored tensor to zero or more (parameter name, index, tensor)
# writes; index None writes the whole parameter, otherwise param[index] = tensor.
WeightSlice = tuple[str, Any, "torch.Tensor"]
CheckpointRule = Callable[[str, "torch.Tensor", "ModelConfig"], Iterable[WeightSlice]]
# (the text config, its rope parameters, the model_type without "_text") -> ModelConfig fields.
ConfigFields = Callable[[dict[str, Any], dict[str, Any], str], dict[str, Any]]


@dataclass(frozen=True)
class SamplingPreset:
    """A registered model shape (recognised from architecture facts, never from its name) and
    the sampling its authors publish for thinking and non-thinking turns."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_experts: int  # 0: dense
    thinking: SamplingParams
    non_thinking: SamplingParams

    def matches(self, config: ModelConfig) -> bool:
        return (
            config.hidden_size == self.hidden_size
            and config.num_hidden_layers == self.num_hidden_layers
            and config.num_experts == self.num_experts
        )


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_types: tuple[str, ...]  # HF model_type values; "<type>_text" (a VLM's trunk) matches too
    model_class: str  # "module:Class", imported when a model is built
    checkpoint_rule: CheckpointRule
    hybrid: bool = False  # Gated DeltaNet layers: recurrent state, reuse only at exact frontiers
    config_fields: ConfigFields = lambda hf, rope, base_type: {}
    sampling_presets: tuple[SamplingPreset, ...] = field(default=())
