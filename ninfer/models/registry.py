"""Which model file and checkpoint rules serve each architecture family."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ninfer.models.config import ModelConfig

# A checkpoint rule maps one stored tensor to zero or more (parameter name, index, tensor)
# writes; index None writes the whole parameter, otherwise param[index] = tensor.
WeightSlice = tuple[str, Any, torch.Tensor]
CheckpointRule = Callable[[str, torch.Tensor, ModelConfig], Iterable[WeightSlice]]

_MODEL_CLASSES = {
    "qwen3_5": "ninfer.models.qwen3_5:Qwen3_5ForCausalLM",
    "qwen3_next": "ninfer.models.qwen3_next:Qwen3NextForCausalLM",
    "llama": "ninfer.models.llama:LlamaForCausalLM",
}
_CHECKPOINT_RULES = {
    "qwen3_5": "ninfer.models.checkpoint.qwen3_5:convert",
    "qwen3_next": "ninfer.models.checkpoint.qwen3_next:convert",
    "llama": "ninfer.models.checkpoint.llama:convert",
}


def _resolve(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def model_class(config: ModelConfig) -> type:
    return _resolve(_MODEL_CLASSES[config.family])


def checkpoint_rule(config: ModelConfig) -> CheckpointRule:
    return _resolve(_CHECKPOINT_RULES[config.family])
