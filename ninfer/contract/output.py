"""EngineOutput: one step's delta for one request, and the errors and stamps it carries."""

from __future__ import annotations

import enum

import msgspec

from ninfer.contract.reuse_path import ReusePath


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
    ENGINE_FAILURE = "engine_failure"  # the engine can no longer serve (the API process restarts it)
    STEP_FAILED = "engine_step_failed"  # one step failed; only its requests end, the engine goes on


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
    vision_seconds: float = 0.0  # the vision tower's time on this request's media


class HostExposure(msgspec.Struct):
    """Host-active seconds of the engine worker by phase; mutually exclusive, total is their sum.
    engine_boundary: receiving and applying messages; program_submit: planning and launching
    steps; program_post: reading sampled ids back; engine_commit_output: committing tokens and
    building outputs; engine_maintenance: throughput records and bookkeeping."""

    engine_boundary: float = 0.0
    program_submit: float = 0.0
    program_post: float = 0.0
    engine_commit_output: float = 0.0
    engine_maintenance: float = 0.0
    total: float = 0.0


class DecodeTiming(msgspec.Struct):
    host_exposed_seconds: float = 0.0
    device_wait_seconds: float = 0.0
    rounds: int = 0


class StepUnits(msgspec.Struct):
    prefill: int = 0  # steps that computed a prompt chunk of this request
    control: int = 0  # steps that only moved state (restores, captures) for it


class EngineTiming(msgspec.Struct):
    """Where a request's time in the engine went. A step's time counts for every request in it
    (each waited for all of it), so these explain one request's latency and must not be summed
    across concurrent requests."""

    queue_wait_seconds: float = 0.0  # arrival in the engine to admission (FIFO wait)
    device_wait_exposed_seconds: float = 0.0  # the host blocked reading the device's results
    host_exposed_seconds: HostExposure = msgspec.field(default_factory=HostExposure)
    decode: DecodeTiming = msgspec.field(default_factory=DecodeTiming)
    units: StepUnits = msgspec.field(default_factory=StepUnits)


class DegradationUnits(msgspec.Struct):
    """What a request's admission took from the context cache, in checkpoints."""

    dropped: int = 0  # checkpoints removed
    kv_spilled: int = 0  # checkpoints whose KV pages went to the host tier
    state_spilled: int = 0  # checkpoints whose StateImage went to the host tier


class Materialization(msgspec.Struct):
    """The admission decision committed for one request: what its plan was predicted to cost now
    (the prompt recomputed past the reused frontier, restores from the host tier) and later (the
    recompute the checkpoints it gave up would have saved), and how the bounded search ended."""

    target: str  # "checkpoint" (resume, copying its state), "adopted_checkpoint" or "root"
    reused_tokens: int
    predicted_immediate_ns: int
    predicted_future_loss_ns: int
    predicted_total_ns: int
    evaluated_targets: int  # plans tried, in order: resume from the best hit, adopt it, shorter hits, root
    projection_work: int  # eviction sets examined across them
    planning_ns: int
    # How the search ended: no_pressure, value_of_next_expansion (the cheapest fitting eviction
    # set), queue_exhausted (every victim), or the bound that cut it short: target_budget (reuse
    # targets past MAX_REUSE_TARGETS left untried), expansion_capacity (past MAX_EXPANSIONS victims
    # the rest of the queue was projected at once), time_budget (planning past its time).
    stop_reason: str
    budget_exhausted: bool  # a bound above was hit, or the cache held more checkpoints than the planner ranks
    degradation_units: DegradationUnits
    maximal_root_fallback: bool  # a checkpoint matched, yet the plan starts from root


class SpeculativeCounters(msgspec.Struct):
    """A request's speculative decoding: rounds that verified drafts, the drafts verified and
    accepted, decode steps that ran without drafts (the first after prefill, forced tokens, the
    output limit), and per draft position the rounds that accepted it."""

    backend: str
    draft_window: int
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    fallback_steps: int = 0
    accepted_per_position: list[int] = []


class TokenLogprobs(msgspec.Struct, frozen=True):
    """A sampled token's log probability and the most likely alternatives at its position: the
    log-softmax of the logits it was drawn from, after an output constraint's mask and before
    penalties, temperature and the top-k / top-p / min-p filters."""

    logprob: float
    top_token_ids: list[int] = []  # most likely first
    top_logprobs: list[float] = []


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
    reuse_path: ReusePath = ReusePath.ROOT
    progress: PromptProgress | None = None
    timings: Timings | None = None
    error: EngineError | None = None
    engine_timing: EngineTiming | None = None  # on the final output only
    materialization: Materialization | None = None  # on the final output of an admitted request
    speculative: SpeculativeCounters | None = None  # on the final output, when a backend is loaded
    # With EngineRequest.top_logprobs set: one entry per new token, None for forced tokens.
    logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
