"""GuardedHttpProtocol: uvicorn's HTTP/1.1 protocol with the two header guards it lacks.

- A request's headers must be complete within HEADER_TIMEOUT_S of its first byte (of the
  connection, for the first request): a client trickling header lines (slowloris) otherwise
  holds a connection, and with enough of them every file descriptor, forever. Late: 408.
- They must fit in MAX_HEADER_BYTES (request line and header fields): the parser accepts any
  size, so one request could make the server buffer megabytes of headers. Too large: 431.
Either way nothing of the request reaches the application and the connection is closed.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("ninfer.server")

HEADER_TIMEOUT_S = 30.0
MAX_HEADER_BYTES = 64 << 10

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class _Rejected(Exception):
    """Raised from a parser callback to stop parsing a rejected request."""


class GuardedHttpProtocol(HttpToolsProtocol):
    header_timeout_s = HEADER_TIMEOUT_S
    max_header_bytes = MAX_HEADER_BYTES

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_deadline: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._rejected = False
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        if self._header_deadline is None:
            self._arm_header_deadline()  # the next request on a kept-alive connection

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_header_deadline()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if not self._rejected:  # a rejection already answered and closed the connection
            super().send_400_response(msg)

    def _count_header_bytes(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.max_header_bytes:
            self._reject(431, f"request headers exceed {self.max_header_bytes} bytes")
            raise _Rejected()

    def _arm_header_deadline(self) -> None:
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self.cycle is None or self.cycle.response_complete:  # no request of this connection is running
            self._reject(408, f"request headers not complete within {self.header_timeout_s:g} s")

    def _reject(self, status: int, message: str) -> None:
        if self._rejected or self.transport.is_closing():
            return
        self._rejected = True
        self._cancel_header_deadline()
        prefix = "%s:%d " % tuple(self.client[:2]) if self.client else ""
        log.info("%sclosed: %d (%s)", prefix, status, message)
        body = message.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, _REASONS[status], len(body), body)
        )
        self.transport.close()
