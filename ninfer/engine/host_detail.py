"""HostDetail: the host's slow paths over one throughput interval, inside the phases HostTime counts.

Four named paths, each timed where it runs and counted per invocation: admission (the admission
pass of a scheduling step), context_transaction (committing a plan's or a capture's changes to
the context cache), replica (copying StateImages and KV pages to or from the host tier) and
stats_publication (building a throughput record). Their seconds are already part of a HostTime
phase (program_submit, engine_commit_output or engine_maintenance), so they are a subset of its
total and never added to it. A path timed inside another (an admission's transaction inside its
pass) counts under the inner path only, so the paths never overlap and their sum is a subset too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

DETAILS = ("admission", "context_transaction", "replica", "stats_publication")


class HostDetail:
    def __init__(self):
        self.seconds = dict.fromkeys(DETAILS, 0.0)
        self.invocations = dict.fromkeys(DETAILS, 0)
        # Per open timed() block, the seconds already counted by paths inside it.
        self._inner: list[float] = []

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        self._inner.append(0.0)
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self._count(name, elapsed - self._inner.pop())
            if self._inner:
                self._inner[-1] += elapsed

    def add(self, name: str, seconds: float, invocations: int = 1) -> None:
        """seconds spent on `name` (inside a timed() block, they are taken out of that block's path)."""
        self._count(name, seconds, invocations)
        if self._inner:
            self._inner[-1] += seconds

    def _count(self, name: str, seconds: float, invocations: int = 1) -> None:
        self.seconds[name] += seconds
        self.invocations[name] += invocations

    def take(self) -> dict:
        """host_work's detail fields for the interval that ends; counting starts again at zero."""
        record = {
            "detail_subset_seconds": dict(self.seconds),
            "detail_invocations": dict(self.invocations),
            "detail_seconds_per_invocation": {
                name: self.seconds[name] / count if (count := self.invocations[name]) else None for name in DETAILS
            },
        }
        self.seconds = dict.fromkeys(DETAILS, 0.0)
        self.invocations = dict.fromkeys(DETAILS, 0)
        return record
