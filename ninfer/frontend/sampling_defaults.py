"""SamplingDefaults: the effective SamplingParams of a request, resolved from four layers.

  1. a preset for the loaded model and the request's thinking mode: a registered preset when
     the architecture is a registered target, else the artifact's generation defaults, else
     neutral values;
  2. process flags (--temperature, --top-p, ... --seed) override the preset;
  3. request fields override the process flags;
  4. --greedy finally forces temperature 0.

Registered targets are recognised from architecture facts in ModelConfig, never from names:
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

NEUTRAL = SamplingParams()  # temperature 1, top_p 1, top_k 0 (the cap), min_p 0, no penalties

# Generation-defaults keys a generic preset reads; repetition_penalty is deliberately not one
# (the engine has no multiplicative penalty, and the API accepts only its neutral value).
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty")


@dataclass(frozen=True)
class RegisteredTarget:
    """Architecture facts that identify one registered model shape, and its presets."""

    name: str
    family: str
    hidden_size: int
    num_hidden_layers: int
    num_experts: int  # 0: dense
    thinking: SamplingParams
    non_thinking: SamplingParams

    def matches(self, config: ModelConfig) -> bool:
        return (
            config.family == self.family
            and config.hidden_size == self.hidden_size
            and config.num_hidden_layers == self.num_hidden_layers
            and config.num_experts == self.num_experts
        )


_QWEN_THINKING = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=0.0)
_QWEN_NON_THINKING = SamplingParams(temperature=0.7, top_p=0.80, top_k=20, min_p=0.0, presence_penalty=1.5)

# Qwen's published presets (temperature/top-p/top-k/min-p/presence penalty): the 27B uses
# 1.0/0.95/20/0/0 when thinking and 0.7/0.80/20/0/1.5 when not; the 35B-A3B differs only in
# its thinking presence penalty, 1.5. Qwen3.5 checkpoints of the same shape match too.
REGISTERED_TARGETS: tuple[RegisteredTarget, ...] = (
    RegisteredTarget(
        name="Qwen3.6/3.8-27B",
        family="qwen3_5",
        hidden_size=5120,
        num_hidden_layers=64,
        num_experts=0,
        thinking=_QWEN_THINKING,
        non_thinking=_QWEN_NON_THINKING,
    ),
    RegisteredTarget(
        name="Qwen3.6-35B-A3B",
        family="qwen3_5",
        hidden_size=2048,
        num_hidden_layers=40,
        num_experts=256,
        thinking=msgspec.structs.replace(_QWEN_THINKING, presence_penalty=1.5),
        non_thinking=_QWEN_NON_THINKING,
    ),
)


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
        for target in REGISTERED_TARGETS:
            if target.matches(config):
                return cls(target.name, target.thinking, target.non_thinking)
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
