"""The architecture families NInfer serves: one family module each (models/families/)."""

from __future__ import annotations

import functools
import importlib

from ninfer.models.family import CheckpointRule, ModelFamily, SamplingPreset, WeightSlice

FAMILY_MODULES = ("qwen3_5", "qwen3_next", "llama")

__all__ = [
    "CheckpointRule",
    "WeightSlice",
    "checkpoint_rule",
    "families",
    "family_for_model_type",
    "model_class",
    "sampling_preset_for",
]


@functools.cache
def families() -> tuple[ModelFamily, ...]:
    return tuple(importlib.import_module(f"ninfer.models.families.{name}").FAMILY for name in FAMILY_MODULES)


def family_named(name: str) -> ModelFamily:
    return next(family for family in families() if family.name == name)


def family_for_model_type(model_type: str) -> ModelFamily | None:
    base_type = model_type.removesuffix("_text")
    return next((f for f in families() if model_type in f.model_types or base_type in f.model_types), None)


def supported_model_types() -> list[str]:
    return sorted(t for family in families() for t in family.model_types)


def model_class(config) -> type:
    module, name = family_named(config.family).model_class.split(":")
    return getattr(importlib.import_module(module), name)


def checkpoint_rule(config) -> CheckpointRule:
    return family_named(config.family).checkpoint_rule


def sampling_preset_for(config) -> SamplingPreset | None:
    """The registered shape the config matches, within its own family."""
    family = family_named(config.family) if config.family in FAMILY_MODULES else None
    return next((preset for preset in family.sampling_presets if preset.matches(config)), None) if family else None
