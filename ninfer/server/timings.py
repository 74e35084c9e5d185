"""llama.cpp-compatible `timings` from the engine's commit stamps.

Prompt time runs from the admission that committed the reuse choice to the first
committed output token (or the end of prefill when nothing is generated); generation
time runs from the first to the last committed token, so its rate counts
max(predicted_n - 1, 0) intervals. Degenerate cases report finite zeros. A request whose
speculative rounds drafted tokens also reports draft_n and draft_n_accepted, as llama.cpp does;
any other request's timings have no draft keys at all.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ninfer.contract.output import SpeculativeCounters
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
    draft_n: int | None = None  # drafted tokens; None (left out) without speculative drafts
    draft_n_accepted: int | None = None

    def to_dict(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value is not None}


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
    speculative: SpeculativeCounters | None = None,
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
    drafted = speculative is not None and speculative.drafted_tokens > 0
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
        draft_n=speculative.drafted_tokens if drafted else None,
        draft_n_accepted=speculative.accepted_tokens if drafted else None,
    )
