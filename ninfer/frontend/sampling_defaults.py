"""SamplingDefaults: the effective SamplingParams of a request, resolved from four layers.

  1. a preset for the loaded model and the request's thinking mode: its family module's
     preset when the architecture is a registered shape, else the artifact's generation
     defaults, else neutral values;
  2. process flags (--temperature, --top-p, ... --seed) override the preset;
  3. request fields override the process flags;
  4. --greedy finally forces temperature 0.

Registered shapes are recognised from architecture facts in ModelConfig, never from names:
the model id is user-chosen and the Qwen3.5/3.6/3.8 generations share one shape.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from ninfer.contract.sampling import TOP_K_CAP, SamplingOverrides, SamplingParams
from ninfer.models.config import ModelConfig
from ninfer.models.registry import sampling_preset_for

NEUTRAL = SamplingParams()  # temperature 1, top_p 1, top_k 0 (the cap), min_p 0, no penalties

# Generation-defaults keys a generic preset reads; repetition_penalty is deliberately not one
# (the engine has no multiplicative penalty, and the API accepts only its neutral value).
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty")


def _valid_generation_default(key: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if key == "temperature":
        return value >= 0
    if key in ("top_p", "min_p"):
        return 0 <= value <= 1
    if key == "top_k":
        return value >= 0 and float(value).is_integer()
    return True  # presence_penalty: any finite value


@dataclass(frozen=True)
class SamplingDefaults:
    name: str  # registered target name, or "generation defaults" / "neutral"
    thinking: SamplingParams
    non_thinking: SamplingParams
    ignored: tuple[str, ...] = ()  # generation-default keys that could not be used, for the log

    @classmethod
    def for_model(cls, config: ModelConfig, generation_defaults: Mapping[str, Any] | None = None) -> SamplingDefaults:
        preset = sampling_preset_for(config)
        if preset is not None:
            return cls(preset.name, preset.thinking, preset.non_thinking)
        source = generation_defaults or {}
        given: dict[str, Any] = {}
        ignored: list[str] = []
        for key in GENERATION_DEFAULT_KEYS:
            if key not in source:
                continue
            value = source[key]
            if _valid_generation_default(key, value):
                # top_k past the cap (HF configs often say 50) means "as many as allowed".
                given[key] = min(int(value), TOP_K_CAP) if key == "top_k" else float(value)
            else:
                ignored.append(key)
        preset = msgspec.structs.replace(NEUTRAL, **given)
        return cls("generation defaults" if given else "neutral", preset, preset, tuple(ignored))

    def preset(self, thinking: bool) -> SamplingParams:
        return self.thinking if thinking else self.non_thinking

    def resolve(
        self,
        thinking: bool,
        process: SamplingOverrides = SamplingOverrides(),
        request: SamplingOverrides = SamplingOverrides(),
        greedy: bool = False,
    ) -> SamplingParams:
        """The request's effective parameters; seed stays None when nobody set one (the engine
        then draws a fresh one at admission)."""
        params = request.apply(process.apply(self.preset(thinking)))
        return msgspec.structs.replace(params, temperature=0.0) if greedy else params

    def describe(self) -> dict[str, Any]:
        """For the start-up log."""

        def values(p: SamplingParams) -> dict[str, float | int]:
            return {
                "temperature": p.temperature,
                "top_p": p.top_p,
                "top_k": p.top_k,
                "min_p": p.min_p,
                "presence_penalty": p.presence_penalty,
                "frequency_penalty": p.frequency_penalty,
            }

        described: dict[str, Any] = {
            "preset": self.name,
            "thinking": values(self.thinking),
            "non_thinking": values(self.non_thinking),
        }
        if self.ignored:
            described["ignored_generation_defaults"] = list(self.ignored)
        return described
