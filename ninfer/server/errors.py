"""APIError: a client-visible failure with its HTTP status, type, field and stable code.

Adapters raise it; app.py renders it in the endpoint's protocol (OpenAI error envelope,
or Anthropic's with request_id). Internal failures are never relabelled as client errors.
"""

from __future__ import annotations


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _default_type(status)

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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
