"""Pure ASGI middleware: request ids, the body limits (size, and silence mid-body) and API-key auth.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses pass through untouched and
the body limit applies before anything parses JSON.
"""

from __future__ import annotations

import asyncio
import hmac
import uuid

from ninfer.server.errors import APIError, error_body, is_anthropic

# Like nginx's client_body_timeout (60 s): the longest silence allowed between two pieces of a body.
BODY_IDLE_TIMEOUT_S = 30


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


class BodyRefused(APIError):
    """The body broke a limit while the app read it. An APIError, so the app renders it in the
    endpoint's protocol like any other refusal (a plain exception would become a 500)."""

    def headers(self) -> dict[str, str]:
        # The rest of the body is never read, so the connection cannot carry another request.
        return {**super().headers(), "connection": "close"}


class BodyLimitMiddleware:
    """--max-request-mib: 413 request_too_large from Content-Length or the bytes actually read; and
    408 request_timeout when a client stops sending in the middle of a body, which would otherwise
    hold the request open for as long as the connection lives."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes
        self.idle_timeout_s = BODY_IDLE_TIMEOUT_S

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        request_id = scope.get("state", {}).get("request_id")
        too_large = BodyRefused(
            413,
            f"the request body exceeds --max-request-mib ({self.max_bytes // (1 << 20)} MiB)",
            code="request_too_large",
        )
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > self.max_bytes:
                        return await send_error(send, path, too_large, request_id)
                except ValueError:
                    pass
        received = 0
        body_complete = False
        started = False

        async def limited_receive():
            nonlocal received, body_complete
            if body_complete:
                return await receive()  # later reads wait for the disconnect, however long a generation runs
            try:
                message = await asyncio.wait_for(receive(), self.idle_timeout_s)
            except TimeoutError:
                raise BodyRefused(
                    408, f"the request body stalled: no bytes for {self.idle_timeout_s:g} s", code="request_timeout"
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large
                body_complete = not message.get("more_body", False)
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyRefused as error:  # raised where the app does not render APIErrors itself
            if not started:
                await send_error(send, path, error, request_id)


PUBLIC_PATHS = ("/health", "/openapi.json")


class AuthMiddleware:
    """--api-key as `Authorization: Bearer KEY` or `x-api-key: KEY`; /health, /openapi.json, the chat page's
    files and preflights stay open (as in vLLM: the document is the same on every server and holds no model
    or secret; the page asks the user for the key its API calls carry)."""

    def __init__(self, app, api_key: str, public_paths: tuple[str, ...] = PUBLIC_PATHS):
        self.app = app
        self.api_key = api_key.encode()
        self.public_paths = frozenset(public_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.public_paths or self._is_preflight(scope):
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
