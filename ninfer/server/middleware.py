"""Pure ASGI middleware: request ids, the body-size limit and API-key auth.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses pass through untouched and
the body limit applies before anything parses JSON.
"""

from __future__ import annotations

import hmac
import uuid

from ninfer.server.errors import APIError, error_body, is_anthropic


async def send_error(send, path: str, error: APIError, request_id: str | None) -> None:
    headers = [(b"content-type", b"application/json")]
    headers += [(name.encode(), value.encode()) for name, value in error.headers().items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": error_body(path, error, request_id)})


class RequestIdMiddleware:
    """Every response gets a unique id: x-request-id (OpenAI-compatible) or request-id (Anthropic)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        anthropic = is_anthropic(path)
        request_id = ("req_" if anthropic else "req-") + uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        header = b"request-id" if anthropic else b"x-request-id"

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != header]
                message = {**message, "headers": [*headers, (header, request_id.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """--max-request-mib: 413 request_too_large from Content-Length or the bytes actually read."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        request_id = scope.get("state", {}).get("request_id")
        error = APIError(
            413,
            f"the request body exceeds --max-request-mib ({self.max_bytes // (1 << 20)} MiB)",
            code="request_too_large",
        )
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > self.max_bytes:
                        return await send_error(send, path, error, request_id)
                except ValueError:
                    pass
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await send_error(send, path, error, request_id)


class AuthMiddleware:
    """--api-key as `Authorization: Bearer KEY` or `x-api-key: KEY`; /health and preflights stay open."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health" or self._is_preflight(scope):
            return await self.app(scope, receive, send)
        presented = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                presented = value[7:].strip()
            elif name == b"x-api-key" and not presented:
                presented = value.strip()
        if not hmac.compare_digest(presented, self.api_key):
            error = APIError(401, "missing or invalid API key", code="invalid_api_key")
            return await send_error(send, scope["path"], error, scope.get("state", {}).get("request_id"))
        await self.app(scope, receive, send)

    @staticmethod
    def _is_preflight(scope) -> bool:
        if scope["method"] != "OPTIONS":
            return False
        return any(name == b"access-control-request-method" for name, _ in scope.get("headers", []))
