"""The typed message protocol between the API process and the engine.

msgspec Structs so the same objects cross the process boundary (msgpack) unchanged;
the engine only ever sees token ids, never text prompts, JSON or templates.
"""

from __future__ import annotations

import enum

import msgspec

from ninfer.engine.context_cache import PRIVATE_ENDPOINT

# Sampling never looks past this many candidates (spec: top_k 0 selects the cap of 20).
TOP_K_CAP = 20


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


class CaptureHint(msgspec.Struct, frozen=True):
    """Ask the engine to keep a checkpoint after `frontier` prompt tokens (a cache write candidate)."""

    frontier: int
    path: str  # reuse path label reported when a later request resumes from it


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
    endpoint_path: str = PRIVATE_ENDPOINT  # reuse path label of this request's own checkpoints
    deadline: float | None = None  # time.monotonic() by which admission must happen


class FinishReason(str, enum.Enum):
    STOP = "stop"  # stop token or stop string
    LENGTH = "length"  # output limit or context ceiling
    CANCELLED = "cancelled"
    ERROR = "error"


class ErrorCode(str, enum.Enum):
    OVERLOADED = "server_overloaded"
    QUEUE_TIMEOUT = "request_queue_timeout"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    THINKING_BUDGET_CAPACITY = "thinking_budget_capacity_insufficient"
    INVALID_REQUEST = "invalid_request"
    ENGINE_FAILURE = "engine_failure"


class EngineError(msgspec.Struct, frozen=True):
    code: ErrorCode
    message: str
    prompt_tokens: int | None = None  # for context_length_exceeded
    max_context: int | None = None


class PromptProgress(msgspec.Struct, frozen=True):
    total: int
    cache: int
    processed: int
    time_ms: float  # since admission committed the reuse choice


class Timings(msgspec.Struct):
    """time.monotonic() stamps (one clock on Linux across processes)."""

    arrived: float = 0.0
    admitted: float | None = None  # admission committed the reuse choice
    prompt_done: float | None = None  # the last prompt token was computed
    first_token: float | None = None
    last_token: float | None = None


class EngineOutput(msgspec.Struct):
    """One step's delta for one request; the last one has finish_reason set."""

    request_id: str
    new_token_ids: list[int] = []
    text: str = ""  # detokenized, UTF-8-complete, stop-safe text of the committed tokens so far unseen
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or the matched stop string
    forced_token_count: int = 0  # tokens in new_token_ids committed without sampling (thinking close)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reuse_path: str = "root"
    progress: PromptProgress | None = None
    timings: Timings | None = None
    error: EngineError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
