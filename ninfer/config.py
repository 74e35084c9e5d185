"""Frozen configuration objects, validated once at start-up (ServeConfig comes with the server)."""

from __future__ import annotations

from dataclasses import dataclass


class ConfigValueError(ValueError):
    """An option value or combination is invalid; the message names the option."""


@dataclass(frozen=True)
class EngineConfig:
    max_concurrency: int = 1  # active lanes, 1..8
    max_pending_requests: int = 16  # extra requests allowed to wait (incl. in preparation)
    pending_timeout_ms: int = 30000  # preparation + admission deadline
    prefill_chunk: int = 1024
    max_context: int = 8192  # per-sequence logical ceiling
    kv_capacity: int | None = None  # Main KV tokens; None follows max_context
    page_size: int = 16
    device_state_slots: int | None = None  # checkpoint slots beyond the active lanes; None = max_concurrency
    prefix_reuse: bool = True
    log_stats_interval_ms: int = 5000
    device: str = "cpu"
    dtype: str | None = None  # None: the artifact's dtype (float32 on CPU for bf16 checkpoints is not implied)

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigValueError(message)

        check(1 <= self.max_concurrency <= 8, "--max-concurrency must be in 1..8")
        check(self.max_pending_requests >= 0, "--max-pending-requests must be >= 0")
        check(self.pending_timeout_ms > 0, "--pending-timeout-ms must be > 0")
        check(self.prefill_chunk >= 1, "--prefill-chunk must be >= 1")
        check(self.max_context >= 2, "--max-context must be >= 2")
        check(self.kv_capacity is None or self.kv_capacity >= 1, "--kv-capacity must be >= 1")
        check(self.page_size >= 1, "page size must be >= 1")
        check(self.device_state_slots is None or self.device_state_slots >= 0, "--device-state-slots must be >= 0")
        check(self.log_stats_interval_ms >= 0, "--log-stats-interval-ms must be >= 0")

    @property
    def kv_tokens(self) -> int:
        return self.kv_capacity if self.kv_capacity is not None else self.max_context

    @property
    def num_kv_pages(self) -> int:
        return -(-self.kv_tokens // self.page_size)

    @property
    def num_state_slots(self) -> int:
        extra = self.max_concurrency if self.device_state_slots is None else self.device_state_slots
        return self.max_concurrency + extra
