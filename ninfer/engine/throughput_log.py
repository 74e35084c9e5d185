"""ThroughputLog: the engine's throughput intervals, one log line and one record each.

An interval accumulates the host's time by phase and step class (`work`), the slow paths inside
those phases (`detail`) and the seconds the host was active; closing it reads the scheduler's
counters and the pools' occupancy. An interval in which nothing was computed and the context
cache did nothing goes unreported. Rates are over the active seconds, so an interval that began
with an idle gap does not read as slow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ninfer.engine.cache.context_cache import ContextCache
from ninfer.engine.host_detail import HostDetail
from ninfer.engine.host_time import HostTime
from ninfer.engine.kv_pool import KVPool
from ninfer.engine.scheduler import Scheduler
from ninfer.engine.state_pool import StatePool

log = logging.getLogger("ninfer.engine")


class ThroughputLog:
    def __init__(
        self, interval_ms: int, clock: Callable[[], float], detail: HostDetail,
        scheduler: Scheduler, cache: ContextCache, kv_pool: KVPool, state_pool: StatePool,
    ):  # fmt: skip
        """interval_ms: --log-stats-interval-ms (0: no records); detail: the interval's slow
        paths, which the scheduler and the runner time into; the rest is what a record reads."""
        self.interval_seconds = interval_ms / 1000.0
        self.clock = clock
        self.detail = detail
        self.work = HostTime()  # this interval's host and device-wait seconds by phase and class
        self.active_seconds = 0.0  # this interval's seconds of host work
        self.records: list[dict] = []  # closed intervals not yet published
        self._last_closed_at = clock()
        self._scheduler = scheduler
        self._cache = cache
        self._kv_pool = kv_pool
        self._state_pool = state_pool

    def reset(self) -> None:
        """Start afresh (the warm-up's synthetic work is not the server's)."""
        self._scheduler.stats.reset()
        self._cache.counters.take(len(self._cache))
        self._cache.counters.last_selection = None
        self.active_seconds = 0.0
        self.work = HostTime()
        self.detail.take()
        self.records.clear()
        self._last_closed_at = self.clock()

    def _active(self) -> bool:
        """Tokens computed or context-cache work done since the last record."""
        stats = self._scheduler.stats
        return bool(stats.prefill_tokens or stats.decode_tokens) or self._cache.counters.has_activity

    def seconds_to_boundary(self) -> float | None:
        """How long until the current interval's record is due; None when records are off or
        the interval has been idle so far."""
        if self.interval_seconds <= 0 or not self._active():
            return None
        return max(0.0, self._last_closed_at + self.interval_seconds - self.clock())

    def close_if_due(self, work_class: str = "control") -> None:
        """Close the interval when it is due; the time spent publishing it is the next interval's
        engine maintenance (work_class: the step it runs beside)."""
        now = self.clock()
        if self.interval_seconds <= 0 or now - self._last_closed_at < self.interval_seconds:
            return
        started = time.perf_counter()
        self._close(now)
        spent = time.perf_counter() - started
        self.work.add(work_class, "engine_maintenance", spent)
        self.detail.add("stats_publication", spent)

    def take_records(self) -> list[dict]:
        records, self.records = self.records, []
        return records

    def _close(self, now: float) -> None:
        elapsed = now - self._last_closed_at
        active_interval = self._active()
        scheduler = self._scheduler
        stats = scheduler.stats.reset()
        active = self.active_seconds
        self.active_seconds = 0.0
        self._last_closed_at = now
        work, self.work = self.work, HostTime()
        detail = self.detail.take()
        cache = self._cache.counters.take(len(self._cache))
        if not active_interval:
            return
        busy = max(min(active, elapsed), 1e-9)
        running = scheduler.running
        prefilling = sum(1 for s in running if s.is_prefilling)
        avg_batch = stats.decode_rows / stats.decode_rounds if stats.decode_rounds else 0.0
        materializing = scheduler.num_materializing
        parts = []
        if stats.prefill_tokens:
            parts.append(f"prefill {stats.prefill_tokens / busy:,.0f} tok/s ({stats.prefill_tokens} tok)")
        if stats.decode_tokens:
            parts.append(f"decode {stats.decode_tokens / busy:,.1f} tok/s ({stats.decode_tokens} tok)")
        parts.append(f"running {len(running)} (prefill {prefilling}, decode {len(running) - prefilling})")
        if scheduler.waiting:
            parts.append(f"waiting {len(scheduler.waiting)}")
        if materializing:
            parts.append(f"materializing {materializing}")
        if scheduler.draining:
            parts.append(f"terminal {len(scheduler.draining)}")
        if stats.decode_rounds:
            parts.append(f"batch {avg_batch:.1f}")
        host = work.host_total
        parts.append(f"host {host:.2f}s ({100 * host / elapsed:.0f}%)")
        log.info("throughput: %s", " · ".join(parts))
        self.records.append({
            "interval_seconds": elapsed,
            "active_seconds": busy,
            "prefill_tokens": stats.prefill_tokens,
            "decode_tokens": stats.decode_tokens,
            "decode_rounds": stats.decode_rounds,
            "decode_row_rounds": stats.decode_rows,
            "average_size": avg_batch if stats.decode_rounds else None,
            "running": len(running),
            "prefilling": prefilling,
            "decode_ready": len(running) - prefilling,
            "waiting": len(scheduler.waiting),
            "materializing": materializing,
            "capture_pending": scheduler.num_capture_pending,
            "terminal_pending": len(scheduler.draining),
            **self.resource_gauges(),
            "host_work": {**work.to_record(stats.decode_rounds, stats.decode_rows), **detail},
            "context_cache": cache,
        })

    def resource_gauges(self) -> dict[str, int]:
        kv_pool, state_pool, cache = self._kv_pool, self._state_pool, self._cache
        host_kv = cache.host_kv_pool
        return {
            "kv_pages_used": kv_pool.num_used,
            "kv_pages_total": kv_pool.num_pages,
            "state_slots_used": state_pool.num_slots - state_pool.num_free,
            "state_slots_total": state_pool.num_slots,
            "host_state_slots_used": cache.host_pool.num_slots - cache.host_pool.num_free,
            "host_state_slots_total": cache.host_pool.num_slots,
            "host_kv_pages_used": host_kv.num_used if host_kv else 0,
            "host_kv_pages_total": host_kv.num_pages if host_kv else 0,
            "checkpoints": len(cache),
        }
