"""Metrics: the `GET /metrics` Prometheus observer of the request events.

Names follow vLLM's (`vllm:` becomes `ninfer:`) so existing dashboards and alerts carry over;
every metric is labelled with `model_name`. Each instance owns its CollectorRegistry, so
several servers in one process (the tests) keep separate counts.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from ninfer.server.served_model import ServedModel

# generate_latest writes the classic text format whatever the library version calls "latest".
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# TTFT spans a cached short prompt (tens of ms) to a cold prefill of a long context (minutes).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# A decode step takes 5-100 ms; the tail is a step that shares its batch with a prefill chunk.
INTER_TOKEN_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# Agent turns with long thinking run for minutes; a one-line answer takes a fraction of a second.
REQUEST_SECONDS_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0)

FINISH_REASONS = ("stop", "length", "cancelled")


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to the context length: token counts span orders of magnitude."""
    buckets: list[int] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return buckets
            buckets.append(step * scale)
        scale *= 10


class Metrics:
    def __init__(self, model_name: str, max_concurrency: int, max_model_len: int):
        self.registry = CollectorRegistry()
        self.max_concurrency = max_concurrency
        labels = ["model_name"]
        reg = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"ninfer:{name}", doc, [*labels, *extra], registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"ninfer:{name}", doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"ninfer:{name}", doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.model_name = model_name
        self.running = gauge("num_requests_running", "Requests in the engine's running batch (prefill or decode).")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for the engine to admit them.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache pages in use (0-1).")
        self.state_slots_usage = gauge(
            "state_slots_usage_perc", "Fraction of recurrent-state slots in use (0-1; hybrid models)."
        )
        self.checkpoints = gauge("prefix_cache_checkpoints", "Prefix-cache checkpoints held for reuse.")

        self.started = counter("requests_started", "Requests that passed preparation, by protocol and streaming.", ("protocol", "stream"))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(model_name)
        self.generation_tokens = counter(
            "generation_tokens", "Generated tokens of finished requests."
        ).labels(model_name)
        self.success = counter("request_success", "Finished requests by finish reason.", ("finished_reason",))
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)
        self.errors = counter(
            "request_errors",
            "Requests that ended without an outcome, by phase: prepare (rejected), admission, generation, cancelled.",
            ("phase", "code", "status"),
        )
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(model_name)
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.").labels(model_name)
        # From request_done's `speculative` counters; present (at zero) without --spec too, so
        # dashboards and alerts need no change when it is turned on.
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative draft rounds.").labels(model_name)
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.").labels(model_name)
        self.spec_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        ).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to the first output token.", TTFT_BUCKETS)
        self.inter_token = histogram(
            "inter_token_latency_seconds", "Gaps between a request's token deliveries.", INTER_TOKEN_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Whole request time.", REQUEST_SECONDS_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Wait from preparation to engine admission.", TTFT_BUCKETS
        )
        self.prefill_time = histogram("request_prefill_time_seconds", "A request's prefill time.", TTFT_BUCKETS)
        self.decode_time = histogram(
            "request_decode_time_seconds", "A request's decode time.", REQUEST_SECONDS_BUCKETS
        )
        buckets = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", buckets)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", buckets
        )

        # Running/waiting follow request events between the engine's throughput records, which
        # come only every --log-stats-interval-ms; the events and the engine reader use two threads.
        self._lock = threading.Lock()
        self._in_flight = 0  # request_start seen, terminal event not yet
        self._num_running = 0
        self._num_waiting = 0

    def record(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "request_start":
            self._on_start(event)
        elif kind == "request_done":
            self._on_done(event)
        elif kind == "request_error":
            self._on_error(event)
        elif kind == "request_rejected":
            self._count_error(event.get("phase") or "prepare", event)
        elif kind == "throughput":
            self._on_throughput(event)

    def close(self) -> None:
        """Nothing to flush: the registry lives as long as the app."""

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _on_start(self, event: dict[str, Any]) -> None:
        stream = event.get("stream")
        stream_label = "" if stream is None else str(bool(stream)).lower()
        self.started.labels(self.model_name, event.get("protocol") or "", stream_label).inc()
        with self._lock:
            self._in_flight += 1
            if self._num_running < self.max_concurrency:
                self._num_running += 1
            else:
                self._num_waiting += 1
            self._publish_queue()

    def _on_done(self, event: dict[str, Any]) -> None:
        self._finish(was_running=True)
        prompt = event.get("prompt_tokens")
        completion = event.get("completion_tokens")
        self.success.labels(self.model_name, event.get("finish_reason") or "").inc()
        if prompt is not None:
            self.prompt_tokens.inc(prompt)
            self.request_prompt_tokens.observe(prompt)
            self.prefix_queries.inc(prompt)
        if completion is not None:
            self.generation_tokens.inc(completion)
            self.request_generation_tokens.observe(completion)
        hits = event.get("prefix_cache_hit_tokens")
        if hits:
            self.prefix_hits.inc(hits)
        timings = event.get("timings_seconds") or {}
        for histogram, key in (
            (self.ttft, "ttft"),
            (self.queue_time, "queue_wait"),
            (self.prefill_time, "prefill"),
            (self.decode_time, "decode"),
            (self.e2e, "total"),
        ):
            seconds = timings.get(key)
            if seconds is not None:
                histogram.observe(seconds)
        for gap in event.get("inter_token_seconds") or ():
            self.inter_token.observe(gap)
        speculative = event.get("speculative") or {}
        self.spec_drafts.inc(speculative.get("rounds") or 0)
        self.spec_draft_tokens.inc(speculative.get("drafted_tokens") or 0)
        self.spec_accepted_tokens.inc(speculative.get("accepted_tokens") or 0)

    def _on_error(self, event: dict[str, Any]) -> None:
        self._finish(was_running=event.get("phase") != "admission")
        self._count_error(event.get("phase") or "", event)

    def _count_error(self, phase: str, event: dict[str, Any]) -> None:
        status = event.get("status")
        status_label = "" if status is None else str(status)
        self.errors.labels(self.model_name, phase, event.get("code") or "", status_label).inc()

    def _finish(self, was_running: bool) -> None:
        with self._lock:
            self._in_flight = max(self._in_flight - 1, 0)
            if was_running and self._num_running > 0:
                # The lane it frees goes to a waiting request, if any.
                if self._num_waiting > 0:
                    self._num_waiting -= 1
                else:
                    self._num_running -= 1
            elif self._num_waiting > 0:
                self._num_waiting -= 1
            elif self._num_running > 0:
                self._num_running -= 1
            self._publish_queue()

    def _on_throughput(self, event: dict[str, Any]) -> None:
        with self._lock:
            # A record can be read after the request_done of a request it still counted: never
            # report more requests than have started and not yet ended.
            running = min(event.get("running", self._num_running), self._in_flight)
            self._num_running = running
            self._num_waiting = min(event.get("waiting", self._num_waiting), self._in_flight - running)
            self._publish_queue()
        self.gauges(event)

    def gauges(self, event: dict[str, Any]) -> None:
        """Pool usage from a throughput record, or from the engine turning idle."""
        for gauge, used_key, total_key in (
            (self.kv_cache_usage, "kv_pages_used", "kv_pages_total"),
            (self.state_slots_usage, "state_slots_used", "state_slots_total"),
        ):
            used, total = event.get(used_key), event.get(total_key)
            if used is not None and total:
                gauge.set(used / total)
        if event.get("checkpoints") is not None:
            self.checkpoints.set(event["checkpoints"])

    def _publish_queue(self) -> None:
        self.running.set(self._num_running)
        self.waiting.set(self._num_waiting)


def install_metrics(serving: ServedModel) -> Metrics:
    """A Metrics observer registered on the serving's request events."""
    metrics = Metrics(serving.model_id, serving.config.engine.max_concurrency, serving.max_model_len)
    serving.events.observers.append(metrics)
    return metrics
