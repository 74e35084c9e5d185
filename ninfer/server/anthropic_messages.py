"""Anthropic Messages (placeholder: every route answers 501 until the adapter lands)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from ninfer.server.errors import APIError
from ninfer.server.serving import Serving


async def _not_yet(request: Request, serving: Serving, **_: str) -> Response:
    raise APIError(501, "the Messages API is not available in this build", code="not_implemented")


create = count_tokens = _not_yet
