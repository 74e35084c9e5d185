"""llama.cpp-compatible `timings` from the engine's commit stamps.

Prompt time runs from the admission that committed the reuse choice to the first
committed output token (or the end of prefill when nothing is generated); generation
time runs from the first to the last committed token, so its rate counts
max(predicted_n - 1, 0) intervals. Degenerate cases report finite zeros.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ninfer.contract.output import Timings as EngineStamps


@dataclass
class Timings:
    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float

    def to_dict(self) -> dict:
        return asdict(self)


def _rate(count: int, ms: float) -> tuple[float, float]:
    """(ms per unit, units per second), zeros when undefined."""
    if count <= 0 or ms <= 0.0:
        return 0.0, 0.0
    return ms / count, count * 1000.0 / ms


def compute_timings(
    stamps: EngineStamps | None,
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
) -> Timings:
    prompt_n = prompt_tokens - cached_tokens
    prompt_ms = predicted_ms = 0.0
    if stamps is not None and stamps.admitted is not None:
        prompt_end = stamps.first_token if stamps.first_token is not None else stamps.prompt_done
        if prompt_end is not None:
            prompt_ms = max(0.0, (prompt_end - stamps.admitted) * 1000.0)
        if stamps.first_token is not None and stamps.last_token is not None:
            predicted_ms = max(0.0, (stamps.last_token - stamps.first_token) * 1000.0)
    prompt_per_token, prompt_per_second = _rate(prompt_n, prompt_ms)
    intervals = max(completion_tokens - 1, 0)
    predicted_per_token, predicted_per_second = _rate(intervals, predicted_ms)
    return Timings(
        cache_n=cached_tokens,
        prompt_n=prompt_n,
        prompt_ms=prompt_ms,
        prompt_per_token_ms=prompt_per_token,
        prompt_per_second=prompt_per_second,
        predicted_n=completion_tokens,
        predicted_ms=predicted_ms,
        predicted_per_token_ms=predicted_per_token,
        predicted_per_second=predicted_per_second,
    )
