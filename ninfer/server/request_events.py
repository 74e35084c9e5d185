"""RequestEvents: the measurement events of one server instance, handed to every observer.

The request log (`--request-log-jsonl`) and the metrics endpoint observe the same events, so
the file and the scrape agree. Every event is a flat JSON-ready dict with the envelope
`schema`, `schema_version`, `event`, `timestamp_unix_ms` and `server_instance_id`; request
events add `request_id` (the HTTP request id) and `request_seq` (monotonic within the
instance). Events never carry prompt or output text, tool arguments or key values.

Events: server_start, request_start, request_rejected, request_done, request_error,
throughput. A request that passes preparation gets exactly one request_start and then exactly
one of request_done / request_error; one that fails preparation gets one request_rejected.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from typing import Any, Protocol

SCHEMA = "ninfer_serve_request_log"
SCHEMA_VERSION = 20

log = logging.getLogger("ninfer.server")


class RequestObserver(Protocol):
    def record(self, event: dict[str, Any]) -> None:
        """Called on the event loop thread (or the engine reader): must not block."""

    def close(self) -> None: ...


class RequestEvents:
    def __init__(self, observers: list[RequestObserver] | None = None):
        self.instance_id = uuid.uuid4().hex
        self.observers: list[RequestObserver] = list(observers or [])
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    def next_seq(self) -> int:
        with self._lock:
            return next(self._seq)

    def emit(self, event: str, fields: dict[str, Any]) -> dict[str, Any]:
        record = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "event": event,
            "timestamp_unix_ms": time.time_ns() // 1_000_000,
            "server_instance_id": self.instance_id,
            **fields,
        }
        for observer in self.observers:
            try:
                observer.record(record)
            except Exception:  # noqa: BLE001 - measurement must never fail a request
                log.exception("request event observer %s failed", type(observer).__name__)
        return record

    def gauges(self, record: dict[str, Any]) -> None:
        """Pool occupancy outside any throughput record (the engine turned idle): no event, so
        the request log is unchanged; observers with a `gauges` method (metrics) take it."""
        for observer in self.observers:
            take = getattr(observer, "gauges", None)
            if take is None:
                continue
            try:
                take(record)
            except Exception:  # noqa: BLE001 - measurement must never fail a request
                log.exception("request event observer %s failed", type(observer).__name__)

    def close(self) -> None:
        for observer in self.observers:
            observer.close()
