"""Frozen configuration objects, validated once at start-up (ServeConfig comes with the server).

Both processes import this module, so it imports neither torch nor the engine: what needs them
(the device, the model's KV formats, the speculative backend) is checked by the engine process
when it starts (engine/startup_checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer.contract.sampling import SamplingOverrides

DEFAULT_HOST_STATE_SLOTS = 8
DEFAULT_LONG_ANCHORS = 2
DEFAULT_HOST_KV_MIB = 8192
# Step token budgets (docs/performance.md, "Serving under load"): a step with no decode rows takes
# a whole 8K (11.6K tok/s from 2K tokens up); beside decode rows, a step of 512 tokens replayed
# from its graph costs ~57 ms with 8 rows on an H100 (27B, bf16): an 8 x 4K burst's inter-token
# p99 59.6 ms against 104.6 at 1024, its makespan 4% longer.
DEFAULT_PREFILL_CHUNK = 8192
DEFAULT_MIXED_PREFILL_CHUNK = 512
def spare_kv_tokens(num_draft_tokens: int) -> int:
    """KV positions a request holds past its prompt and output: a speculative round writes the
    pending token and K draft places past the last committed token (0 without speculation)."""
    return num_draft_tokens + 1 if num_draft_tokens else 0


# Speculative backends and the draft counts each accepts (--spec, --draft-tokens).
SPEC_DRAFT_RANGES = {"mtp": (1, 5), "dflash": (1, 15), "dflash2": (1, 15)}


class ConfigValueError(ValueError):
    """An option value or combination is invalid; the message names the option."""


KV_DTYPE_NAMES = ("bf16", "int8", "fp8", "nvfp4", "k8v4")  # models/kv_cache.py's KV_DTYPES
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class EngineConfig:
    max_concurrency: int = 1  # active lanes, 1..8
    max_pending_requests: int = 16  # extra requests allowed to wait (incl. in preparation)
    pending_timeout_ms: int = 30000  # preparation + admission deadline
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens of a step with no decode rows
    mixed_prefill_chunk: int = DEFAULT_MIXED_PREFILL_CHUNK  # tokens of a step with decode rows, theirs included
    max_context: int = 8192  # per-sequence logical ceiling
    kv_capacity: int | None = None  # Main KV tokens; None follows max_context
    page_size: int = 16
    device_state_slots: int | None = None  # checkpoint slots beyond the active lanes; None = max_concurrency
    host_state_slots: int | None = None  # pinned host checkpoint StateImages; None = 8 (0 without prefix reuse)
    host_kv_mib: int | None = None  # pinned host KV for spilled checkpoints, MiB; None = 8192 (0 without prefix reuse)
    max_private_continuations: int | None = None  # conversations with private checkpoints; None = 2 * max_concurrency
    max_shared_prefixes: int | None = None  # shared stable-prefix checkpoints; None = max(max_concurrency, 4)
    max_long_anchors: int | None = None  # long-anchor checkpoints per continuation; None = 2
    context_cost_presets: str | None = None  # JSON file overriding the cache planner's rates
    prefix_reuse: bool = True
    cuda_graphs: bool = True  # capture decode graphs at start-up (CUDA only); --no-cuda-graph turns it off
    step_graphs: bool = True  # and prompt / mixed step graphs (engine/step_graphs.py); --no-step-graphs
    # Launch decode round N+1 before reading round N. None: where the device runs
    # asynchronously (CUDA); on the CPU it would only delay each token by a round.
    # --no-decode-overlap sets False.
    decode_overlap: bool | None = None
    log_stats_interval_ms: int = 5000
    device: str = "cpu"
    spec: str | None = None  # speculative backend: mtp | dflash | dflash2; None: plain decode
    draft_tokens: int | None = None  # drafts verified per round (required with spec)
    lm_head_draft: bool = False  # draft through the reduced-vocabulary proposal head
    # The drafter's weights in FP8 per output channel (the MTP head's or the DFlash drafter's Linear
    # layers, the reduced proposal head): half the bytes a draft step reads; drafts only, outputs exact.
    draft_fp8: bool = False
    # Each request drafts only while its acceptance pays for the round (engine/speculative/draft_policy.py);
    # --no-adaptive-drafts verifies K drafts every round.
    adaptive_drafts: bool = True
    vision: bool = False  # load the vision tower: prompts may carry images and videos
    kv_dtype: str = "bf16"  # KV storage: bf16 (plain, the model's dtype) | int8 | fp8 | nvfp4 | k8v4
    tensor_parallel: int = 1  # ranks the model is split over, one engine process each (ninfer/parallel/)

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigValueError(message)

        check(self.kv_dtype in KV_DTYPE_NAMES, f"--kv-dtype must be one of {', '.join(KV_DTYPE_NAMES)}")
        check(self.tensor_parallel in TENSOR_PARALLEL_SIZES, "--tensor-parallel must be 1, 2, 4 or 8")
        check(self.spec is None or self.spec in SPEC_DRAFT_RANGES, "--spec must be mtp, dflash or dflash2")
        if self.spec is None:
            check(self.draft_tokens is None, "--draft-tokens needs --spec mtp|dflash|dflash2")
            check(not self.lm_head_draft, "--lm-head-draft needs --spec mtp|dflash|dflash2")
            check(not self.draft_fp8, "--draft-fp8 needs --spec mtp|dflash|dflash2")
        else:
            low, high = SPEC_DRAFT_RANGES[self.spec]
            check(self.draft_tokens is not None, f"--spec {self.spec} needs --draft-tokens N ({low}..{high})")
            check(low <= self.draft_tokens <= high, f"--draft-tokens for --spec {self.spec} must be in {low}..{high}")

        check(1 <= self.max_concurrency <= 8, "--max-concurrency must be in 1..8")
        check(self.max_pending_requests >= 0, "--max-pending-requests must be >= 0")
        check(self.pending_timeout_ms > 0, "--pending-timeout-ms must be > 0")
        check(self.prefill_chunk >= 1, "--prefill-chunk must be >= 1")
        check(self.mixed_prefill_chunk >= 1, "--mixed-prefill-chunk must be >= 1")
        check(self.max_context >= 2, "--max-context must be >= 2")
        check(self.kv_capacity is None or self.kv_capacity >= 1, "--kv-capacity must be >= 1")
        check(self.page_size >= 1, "page size must be >= 1")
        check(self.device_state_slots is None or self.device_state_slots >= 0, "--device-state-slots must be >= 0")
        check(self.host_state_slots is None or self.host_state_slots >= 0, "--host-state-slots must be >= 0")
        for flag, value in (
            ("--host-kv-mib", self.host_kv_mib),
            ("--max-private-continuations", self.max_private_continuations),
            ("--max-shared-prefixes", self.max_shared_prefixes),
            ("--max-long-anchors-per-continuation", self.max_long_anchors),
        ):
            check(value is None or value >= 0, f"{flag} must be >= 0")
        check(self.log_stats_interval_ms >= 0, "--log-stats-interval-ms must be >= 0")

    @property
    def num_draft_tokens(self) -> int:
        """Drafts a speculative round verifies per request (0: no speculation)."""
        return self.draft_tokens or 0 if self.spec is not None else 0

    @property
    def spare_kv_tokens(self) -> int:
        return spare_kv_tokens(self.num_draft_tokens)

    @property
    def kv_tokens(self) -> int:
        return self.kv_capacity if self.kv_capacity is not None else self.max_context + self.spare_kv_tokens

    @property
    def step_graph_tokens(self) -> int:
        """The largest prompt or mixed step captured in a CUDA graph (engine/step_graphs.py): a mixed
        step's budget (its decode rows included), at least 1,024 tokens and at most 2,048 (larger
        steps keep the GPU busy while the host issues them) and --prefill-chunk; 0 without graphs.
        A larger step runs eagerly."""
        if not (self.cuda_graphs and self.step_graphs):
            return 0
        return min(max(self.mixed_prefill_chunk, 1024), 2048, self.prefill_chunk)

    @property
    def num_kv_pages(self) -> int:
        return -(-self.kv_tokens // self.page_size)

    @property
    def num_state_slots(self) -> int:
        extra = self.max_concurrency if self.device_state_slots is None else self.device_state_slots
        return self.max_concurrency + extra

    @property
    def num_host_state_slots(self) -> int:
        if not self.prefix_reuse:
            return 0
        return DEFAULT_HOST_STATE_SLOTS if self.host_state_slots is None else self.host_state_slots

    @property
    def host_kv_bytes(self) -> int:
        if not self.prefix_reuse:
            return 0
        return (DEFAULT_HOST_KV_MIB if self.host_kv_mib is None else self.host_kv_mib) << 20

    @property
    def num_private_continuations(self) -> int:
        if not self.prefix_reuse:
            return 0
        value = self.max_private_continuations
        return 2 * self.max_concurrency if value is None else value

    @property
    def num_shared_prefixes(self) -> int:
        if not self.prefix_reuse:
            return 0
        return max(self.max_concurrency, 4) if self.max_shared_prefixes is None else self.max_shared_prefixes

    @property
    def num_long_anchors(self) -> int:
        if not self.prefix_reuse:
            return 0
        return DEFAULT_LONG_ANCHORS if self.max_long_anchors is None else self.max_long_anchors


@dataclass(frozen=True)
class ServeConfig:
    engine: EngineConfig
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)  # --temperature … --seed
    artifact: str | None = None  # None: the embedded default model
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    model_id: str | None = None  # public alias override
    cors: bool = False
    web_ui: bool = True  # the chat page at / (--no-web-ui turns it off)
    max_request_mib: int = 384
    default_max_tokens: int = 8192
    default_thinking_budget: int | None = None
    no_thinking: bool = False
    preserve_thinking: bool = False
    tolerant_tool_calls: bool = False
    greedy: bool = False
    log_level: str = "info"
    dtype: str = "auto"  # auto: the artifact's dtype on GPU; on CPU float32 with float16 Linear weights
    quantize: str | None = None  # "fp8" | "nvfp4": bf16 Linear layers quantized at load
    # --device: a CUDA index the engine resolves where it runs (CPU when no GPU is present);
    # None keeps engine.device as given.
    device_index: int | None = None
    engine_process: bool = True  # False: the engine runs in a thread of the API process
    response_store_max_records: int = 1024
    response_store_max_mib: int = 256
    request_log_jsonl: str | None = None  # the measurement log (JSONL), appended to
    # Media (with engine.vision): prepared payloads kept for reuse, all live payloads, the
    # preparation pool (0: automatic), and whether URLs may name private-network addresses.
    media_cache_mib: int = 1024
    media_live_mib: int = 2048
    media_preprocess_threads: int = 0
    media_allow_private_networks: bool = False
    argv: tuple[str, ...] = ()  # the command line, for the server_start record (the API key redacted there)

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigValueError(message)

        check(1 <= self.port <= 65535, "--port must be in 1..65535")
        check(self.api_key is None or len(self.api_key) > 0, "--api-key must not be empty")
        check(self.model_id is None or len(self.model_id) > 0, "--model-id must not be empty")
        check(self.max_request_mib >= 1, "--max-request-mib must be >= 1")
        check(self.default_max_tokens >= 1, "--default-max-tokens must be >= 1")
        check(
            self.default_thinking_budget is None or self.default_thinking_budget >= 1,
            "--default-thinking-budget must be a positive integer",
        )
        check(self.response_store_max_records >= 0, "--response-store-max-records must be >= 0")
        check(self.response_store_max_mib >= 0, "--response-store-max-mib must be >= 0")
        check(self.dtype in ("auto", "bfloat16", "float16", "float32"), "--dtype must be auto, bfloat16, float16 or float32")
        check(self.quantize in (None, "fp8", "nvfp4"), "--quantize must be fp8 or nvfp4")
        check(self.media_cache_mib >= 0, "--media-cache-mib must be >= 0")
        check(self.media_live_mib >= 1, "--media-live-mib must be >= 1")
        check(self.media_cache_mib <= self.media_live_mib, "--media-cache-mib must not exceed --media-live-mib (retained payloads are live)")
        check(0 <= self.media_preprocess_threads <= 16, "--media-preprocess-threads must be in 0..16 (0: automatic)")


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process builds its core from (picklable: it crosses to the spawned process)."""

    artifact_path: str
    engine: EngineConfig
    dtype: str = "auto"
    quantize: str | None = None  # "fp8" | "nvfp4": the model's Linear layers quantized at load
    kv_capacity_auto: bool = False
    device_index: int | None = None  # ServeConfig.device_index: resolved by the engine, replacing engine.device
