"""TokenizerClock: the time one prompt build spends encoding text, however deep the calls are.

The prompt builder encodes the rendered prompt and, for its cache frontiers, some prefixes of
it, from several helpers and on a worker thread; a context variable lets each Tokenizer encode
charge the build that is measuring without threading a timer through every call. Builds on
other threads (or none) are not charged.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar

_measuring: ContextVar[TokenizerClock | None] = ContextVar("ninfer_tokenizer_clock", default=None)


class TokenizerClock:
    def __init__(self):
        self.encode_seconds = 0.0
        self.encode_calls = 0

    @contextlib.contextmanager
    def measuring(self) -> Iterator[TokenizerClock]:
        token = _measuring.set(self)
        try:
            yield self
        finally:
            _measuring.reset(token)


@contextlib.contextmanager
def encode_timed() -> Iterator[None]:
    """Around one encode: its wall time goes to the clock measuring this context, if any."""
    clock = _measuring.get()
    if clock is None:
        yield
        return
    started = time.perf_counter()
    try:
        yield
    finally:
        clock.encode_seconds += time.perf_counter() - started
        clock.encode_calls += 1
