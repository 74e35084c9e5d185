"""Server-sent events with a heartbeat: `: keep-alive` after 5 s without an event."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

KEEPALIVE_SECONDS = 5.0
KEEPALIVE_FRAME = b": keep-alive\n\n"


def data_frame(payload: object) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def event_frame(event: str, payload: object) -> bytes:
    """Named event (Responses, Anthropic): the SSE event name and the JSON type match."""
    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    return b"event: " + event.encode() + b"\ndata: " + body + b"\n\n"


DONE_FRAME = b"data: [DONE]\n\n"


async def with_keepalive(frames: AsyncIterator[bytes], interval: float = KEEPALIVE_SECONDS) -> AsyncIterator[bytes]:
    """Forward frames, inserting a comment whenever `interval` passes without one.

    The pending __anext__ is never cancelled by the timeout (that would break the inner
    generator); on client disconnect the whole chain is closed, which aborts the request.
    """
    iterator = frames.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEPALIVE_FRAME
                continue
            try:
                frame = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield frame
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await pending
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
