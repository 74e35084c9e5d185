"""The request-log events as the report reads them: typed views of the fields it uses.

Each line is converted into one of these; a line whose fields do not fit (a missing key, a
string where a number belongs) is skipped with msgspec's message naming the field. Fields the
report does not read are ignored, so the views stay valid as the schema adds fields.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Envelope(msgspec.Struct):
    schema: str
    schema_version: int
    event: str
    timestamp_unix_ms: int
    server_instance_id: str


class Identity(msgspec.Struct):
    model_id: str
    model_type: str
    dtype: str
    weight_format: str | None = None  # absent from logs written before it was recorded


class Device(msgspec.Struct):
    type: str
    name: str


class ServerStart(msgspec.Struct):
    timestamp_unix_ms: int
    identity: Identity
    capacities: dict[str, Any]
    device: Device


class RequestStart(msgspec.Struct):
    timestamp_unix_ms: int
    request_id: str
    request_seq: int
    prompt_tokens: int


class RequestRejected(msgspec.Struct):
    timestamp_unix_ms: int
    status: int | None
    code: str | None


class RequestTimings(msgspec.Struct):
    ttft: float | None
    decode: float | None
    total: float


class RequestDone(msgspec.Struct):
    timestamp_unix_ms: int
    request_id: str
    request_seq: int
    prompt_tokens: int
    completion_tokens: int
    prefix_cache_hit_tokens: int
    prefix_reuse_path: str
    timings_seconds: RequestTimings
    inter_token_seconds: list[float]

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after the first over first-to-last token time; None without two tokens and a
        decode time."""
        decode = self.timings_seconds.decode
        if self.completion_tokens < 2 or not decode:
            return None
        return (self.completion_tokens - 1) / decode

    @property
    def prefix_hit_fraction(self) -> float | None:
        return self.prefix_cache_hit_tokens / self.prompt_tokens if self.prompt_tokens else None


class RequestError(msgspec.Struct):
    timestamp_unix_ms: int
    request_id: str
    phase: str
    status: int | None
    code: str | None


class HostElapsed(msgspec.Struct):
    """Host-active seconds by phase; `total` is their sum."""

    engine_boundary: float
    program_submit: float
    program_post: float
    engine_commit_output: float
    engine_maintenance: float
    total: float


HOST_PHASES = tuple(name for name in HostElapsed.__struct_fields__ if name != "total")


class HostWork(msgspec.Struct):
    elapsed_seconds: HostElapsed
    device_wait_seconds: float
    # The slow paths inside the phases (admission, context_transaction, replica, stats_publication);
    # empty in logs written before they were recorded.
    detail_subset_seconds: dict[str, float] = {}
    detail_invocations: dict[str, int] = {}


class Selection(msgspec.Struct):
    hits: dict[str, int]
    hit_tokens: int
    misses: int
    historical_forks: int = 0


class Transfer(msgspec.Struct):
    state_spills: int
    state_restores: int
    kv_spills: int
    kv_restores: int


class Degradation(msgspec.Struct):
    state_spills: int = 0
    kv_spills: int = 0
    evictions: int = 0


class Pressure(msgspec.Struct):
    searches: int = 0
    stop_reasons: dict[str, int] = {}
    budget_exhausted: int = 0
    maximal_root_fallbacks: int = 0
    degradation: dict[str, Degradation] = {}


class LastSelection(msgspec.Struct):
    target: str
    reuse_path: str
    reused_tokens: int
    prompt_tokens: int
    stop_reason: str


class ContextCache(msgspec.Struct):
    """Interval counters; pressure and last_selection are absent from logs written before them."""

    selection: Selection
    capture: dict[str, int]
    transfer: Transfer
    cow_pages: int
    adoptions: int
    drops: int
    occupancy: int
    pressure: Pressure = msgspec.field(default_factory=Pressure)
    last_selection: LastSelection | None = None


class Throughput(msgspec.Struct):
    timestamp_unix_ms: int
    interval_seconds: float
    active_seconds: float
    prefill_tokens: int
    decode_tokens: int
    decode_rounds: int
    decode_row_rounds: int
    average_size: float | None
    host_work: HostWork
    materializing: int = 0
    capture_pending: int = 0
    context_cache: ContextCache | None = None


EVENT_TYPES: dict[str, type[msgspec.Struct]] = {
    "server_start": ServerStart,
    "request_start": RequestStart,
    "request_rejected": RequestRejected,
    "request_done": RequestDone,
    "request_error": RequestError,
    "throughput": Throughput,
}
