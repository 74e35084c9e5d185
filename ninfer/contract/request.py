"""EngineRequest: one generation as the engine receives it (token ids, sampling, stops, budgets, hints)."""

from __future__ import annotations

import msgspec

from ninfer.contract.constraint import OutputConstraint
from ninfer.contract.media import MediaInput
from ninfer.contract.reuse_path import ReusePath
from ninfer.contract.sampling import SamplingParams


class CaptureHint(msgspec.Struct, frozen=True):
    """Ask the engine to keep a checkpoint after `frontier` prompt tokens (a cache write candidate)."""

    frontier: int
    path: ReusePath  # reported when a later request resumes from it
    implicit: bool = False  # a shared prefix no client asked for (OpenAI's implicit cache candidate)


class ThinkingBudget(msgspec.Struct, frozen=True):
    """Cap on model-origin thinking tokens; the prompt already opened thinking."""

    max_thinking_tokens: int
    close_token_ids: list[int]  # canonical early-close guidance + </think>, committed without sampling
    think_end_token_id: int  # </think>: a natural close ends the budget


class EngineRequest(msgspec.Struct, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 256  # effective output limit; 0 = prompt processing only
    stop_token_ids: list[int] = []
    stop_strings: list[str] = []
    thinking_budget: ThinkingBudget | None = None
    capture_hints: list[CaptureHint] = []
    session_key: str | None = None  # chain identity for preferring its checkpoints
    endpoint_path: ReusePath = ReusePath.PRIVATE_ENDPOINT  # label of this request's own checkpoints
    deadline: float | None = None  # time.monotonic() by which admission must happen
    # Images and videos in prompt order; their tokens in prompt_token_ids are the placeholder ids.
    media: list[MediaInput] = []
    constraint: OutputConstraint | None = None  # a grammar the answer follows (structured outputs)
    # Log probabilities of the sampled tokens with this many alternatives each (0..20); None: none.
    top_logprobs: int | None = None
