"""Sampling parameters as the engine applies them, and one layer of optional overrides."""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

import msgspec

# Sampling never looks past this many candidates (top_k 0 selects the cap of 20).
TOP_K_CAP = 20


def fresh_seed() -> int:
    """A random seed for a request that brought none (non-negative, fits a signed 64-bit field).
    The API process draws it, so the request log holds the seed that reproduces the output; the
    engine draws one only for a request that still arrives without (offline use)."""
    return secrets.randbits(63)


class SamplingParams(msgspec.Struct, frozen=True):
    temperature: float = 1.0  # 0 selects greedy argmax
    top_p: float = 1.0
    top_k: int = 0  # 0..20; 0 means the cap of 20
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # signed; None: the engine draws a fresh one

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def effective_top_k(self) -> int:
        return TOP_K_CAP if self.top_k <= 0 else min(self.top_k, TOP_K_CAP)


@dataclass(frozen=True)
class SamplingOverrides:
    """One layer of optional overrides: process flags or request fields (None: not given)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None

    def apply(self, params: SamplingParams) -> SamplingParams:
        given = {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}
        return msgspec.structs.replace(params, **given) if given else params
