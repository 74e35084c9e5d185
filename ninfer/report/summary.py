"""RunSummary: the numbers the report states about one server run."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from ninfer.report.campaign import ServerRun
from ninfer.report.distribution import Distribution
from ninfer.report.events import HOST_PHASES, LastSelection, ServerStart, Throughput

OWNERS = ("private", "shared")
DEGRADATIONS = ("state_spills", "kv_spills", "evictions")


@dataclass(frozen=True)
class ReusePath:
    """Finished requests whose prompt reused the cache along one path (`root`: nothing reused)."""

    requests: int
    prompt_tokens: int
    hit_tokens: int

    @property
    def hit_fraction(self) -> float | None:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass(frozen=True)
class ThroughputTotals:
    """Sums over the engine's throughput records (each covers one interval in which it worked)."""

    records: int
    interval_seconds: float
    active_seconds: float
    prefill_tokens: int
    decode_tokens: int
    decode_rounds: int
    decode_row_rounds: int
    batch_records: int  # records with decode rounds: the only ones with an average_size
    mean_average_size: float | None
    host_seconds: float
    device_wait_seconds: float
    host_phase_seconds: dict[str, float]
    detail_seconds: dict[str, float]  # slow paths inside the phases (a subset of host_seconds)
    detail_invocations: dict[str, int]

    @property
    def rows_per_round(self) -> float | None:
        """The decode batch over every round, however the rounds fall into intervals."""
        return self.decode_row_rounds / self.decode_rounds if self.decode_rounds else None


@dataclass(frozen=True)
class CacheTotals:
    """Sums of the throughput records' context-cache counters, the gauges' peaks and the latest
    admission decision (records written before a counter existed count as zero)."""

    records: int  # throughput records with a context_cache object
    hits: dict[str, int]  # admissions resuming a checkpoint, by reuse path
    hit_tokens: int
    misses: int
    historical_forks: int
    captures: dict[str, int]
    state_spills: int
    state_restores: int
    kv_spills: int
    kv_restores: int
    cow_pages: int
    adoptions: int
    drops: int
    pressure_searches: int
    stop_reasons: dict[str, int]
    budget_exhausted: int
    maximal_root_fallbacks: int
    degradation: dict[str, dict[str, int]]  # owner -> spills and evictions pressure caused
    peak_materializing: int
    peak_capture_pending: int
    last_selection: LastSelection | None


@dataclass(frozen=True)
class RunSummary:
    instance_id: str
    model_id: str | None  # None: the run's server_start is not in the file
    device: str | None
    dtype: str | None
    weight_format: str | None
    start_unix_ms: int
    capacities: dict[str, Any]
    started: int
    done: int
    errors: dict[tuple[str, str | None], int]  # (phase, code) -> requests
    rejected: dict[str | None, int]  # code -> requests
    without_terminal: int  # started, but neither done nor errored in this file
    ttft_seconds: Distribution
    e2e_seconds: Distribution
    inter_token_seconds: Distribution
    inter_token_requests: int
    decode_tokens_per_second: Distribution
    prompt_tokens: int
    prefix_hit_tokens: int
    reuse_paths: dict[str, ReusePath]
    throughput: ThroughputTotals
    cache: CacheTotals

    @property
    def prefix_hit_fraction(self) -> float | None:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else None


def summarize(run: ServerRun) -> RunSummary:
    start = run.start
    done = run.done
    terminal_ids = {event.request_id for event in done} | {event.request_id for event in run.errors}
    gaps = [gap for event in done for gap in event.inter_token_seconds]
    return RunSummary(
        instance_id=run.instance_id,
        model_id=start.identity.model_id if start else None,
        device=_device(start) if start else None,
        dtype=start.identity.dtype if start else None,
        weight_format=start.identity.weight_format if start else None,
        start_unix_ms=run.origin_unix_ms,
        capacities=dict(start.capacities) if start else {},
        started=len(run.started),
        done=len(done),
        errors=dict(Counter((event.phase, event.code) for event in run.errors)),
        rejected=dict(Counter(event.code for event in run.rejected)),
        without_terminal=sum(event.request_id not in terminal_ids for event in run.started),
        ttft_seconds=Distribution.of(e.timings_seconds.ttft for e in done if e.timings_seconds.ttft is not None),
        e2e_seconds=Distribution.of(event.timings_seconds.total for event in done),
        inter_token_seconds=Distribution.of(gaps),
        inter_token_requests=sum(bool(event.inter_token_seconds) for event in done),
        decode_tokens_per_second=Distribution.of(
            rate for rate in (event.decode_tokens_per_second for event in done) if rate is not None),
        prompt_tokens=sum(event.prompt_tokens for event in done),
        prefix_hit_tokens=sum(event.prefix_cache_hit_tokens for event in done),
        reuse_paths=_reuse_paths(run),
        throughput=_throughput_totals(run),
        cache=_cache_totals(run.throughput),
    )


def _device(start: ServerStart) -> str:
    device = start.device
    return device.type if device.name == device.type else f"{device.type} ({device.name})"


def _reuse_paths(run: ServerRun) -> dict[str, ReusePath]:
    paths: dict[str, list] = {}
    for event in run.done:
        paths.setdefault(event.prefix_reuse_path, []).append(event)
    by_requests = sorted(paths.items(), key=lambda item: -len(item[1]))
    return {path: ReusePath(len(events), sum(e.prompt_tokens for e in events),
                            sum(e.prefix_cache_hit_tokens for e in events)) for path, events in by_requests}


def _throughput_totals(run: ServerRun) -> ThroughputTotals:
    records = run.throughput
    sizes = [record.average_size for record in records if record.average_size is not None]
    return ThroughputTotals(
        records=len(records),
        interval_seconds=sum(record.interval_seconds for record in records),
        active_seconds=sum(record.active_seconds for record in records),
        prefill_tokens=sum(record.prefill_tokens for record in records),
        decode_tokens=sum(record.decode_tokens for record in records),
        decode_rounds=sum(record.decode_rounds for record in records),
        decode_row_rounds=sum(record.decode_row_rounds for record in records),
        batch_records=len(sizes),
        mean_average_size=sum(sizes) / len(sizes) if sizes else None,
        host_seconds=sum(record.host_work.elapsed_seconds.total for record in records),
        device_wait_seconds=sum(record.host_work.device_wait_seconds for record in records),
        host_phase_seconds={
            phase: sum(getattr(record.host_work.elapsed_seconds, phase) for record in records) for phase in HOST_PHASES
        },
        detail_seconds=_sum_maps(record.host_work.detail_subset_seconds for record in records),
        detail_invocations=_sum_maps(record.host_work.detail_invocations for record in records),
    )


def _sum_maps(maps) -> dict:
    total: Counter = Counter()
    for values in maps:
        total.update(values)
    return dict(total)


def _cache_totals(records: list[Throughput]) -> CacheTotals:
    caches = [record.context_cache for record in records if record.context_cache is not None]
    degradation = {owner: dict.fromkeys(DEGRADATIONS, 0) for owner in OWNERS}
    for cache in caches:
        for owner, counts in cache.pressure.degradation.items():
            for kind in DEGRADATIONS:
                degradation.setdefault(owner, dict.fromkeys(DEGRADATIONS, 0))[kind] += getattr(counts, kind)
    last = next((cache.last_selection for cache in reversed(caches) if cache.last_selection is not None), None)
    return CacheTotals(
        records=len(caches),
        hits=_sum_maps(cache.selection.hits for cache in caches),
        hit_tokens=sum(cache.selection.hit_tokens for cache in caches),
        misses=sum(cache.selection.misses for cache in caches),
        historical_forks=sum(cache.selection.historical_forks for cache in caches),
        captures=_sum_maps(cache.capture for cache in caches),
        state_spills=sum(cache.transfer.state_spills for cache in caches),
        state_restores=sum(cache.transfer.state_restores for cache in caches),
        kv_spills=sum(cache.transfer.kv_spills for cache in caches),
        kv_restores=sum(cache.transfer.kv_restores for cache in caches),
        cow_pages=sum(cache.cow_pages for cache in caches),
        adoptions=sum(cache.adoptions for cache in caches),
        drops=sum(cache.drops for cache in caches),
        pressure_searches=sum(cache.pressure.searches for cache in caches),
        stop_reasons=_sum_maps(cache.pressure.stop_reasons for cache in caches),
        budget_exhausted=sum(cache.pressure.budget_exhausted for cache in caches),
        maximal_root_fallbacks=sum(cache.pressure.maximal_root_fallbacks for cache in caches),
        degradation=degradation,
        peak_materializing=max((record.materializing for record in records), default=0),
        peak_capture_pending=max((record.capture_pending for record in records), default=0),
        last_selection=last,
    )
