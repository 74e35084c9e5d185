"""APIError: a client-visible failure with its HTTP status, type, field and stable code.

Adapters raise it; the app renders it in the endpoint's protocol: OpenAI's error envelope, or
Anthropic's with request_id. Internal failures are never relabelled as client errors.
"""

from __future__ import annotations

import json

ANTHROPIC_PREFIX = "/v1/messages"
# Seconds a client should wait after a capacity refusal. Some agent clients (Codex) give up at
# once on a 429 that carries no Retry-After, but retry one that does.
RETRY_AFTER_SECONDS = 1
_RETRYABLE = (429, 503, 504, 529)
# Messages quote the offending value; a 10 MB value must not come back as a 10 MB error (or log line).
MAX_MESSAGE_CHARS = 1000

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        retry_after_s: int | None = None,
    ):
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + "... (truncated)"
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _default_type(status)
        self.retry_after_s = retry_after_s  # None: RETRY_AFTER_SECONDS

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_type(self) -> str:
        return _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")

    def anthropic_body(self, request_id: str | None) -> dict:
        # Anthropic's envelope has no param, so the message names the field when it does not already.
        message = self.message if not self.param or self.param in self.message else f"{self.param}: {self.message}"
        body: dict = {"type": "error", "error": {"type": self.anthropic_type(), "message": message}}
        if request_id:
            body["request_id"] = request_id
        return body

    def headers(self) -> dict[str, str]:
        if self.status not in _RETRYABLE:
            return {}
        return {"retry-after": str(self.retry_after_s or RETRY_AFTER_SECONDS)}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_body(path: str, error: APIError, request_id: str | None) -> bytes:
    """The error in the endpoint's protocol, chosen by path (middleware errors come before routing)."""
    body = error.anthropic_body(request_id) if is_anthropic(path) else error.openai_body()
    return json.dumps(body).encode()


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    """A malformed value: 400 naming the field."""
    return APIError(400, message, code=code, param=param)


def unsupported(param: str, guarantee: str) -> APIError:
    """A recognised option whose behaviour the engine cannot provide: 400 naming field and guarantee."""
    return APIError(400, f"{param}: {guarantee}", code="unsupported_parameter", param=param)
