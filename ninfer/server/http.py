"""HTTP helpers every route uses: request ids, JSON bodies off the event loop, error responses."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import Response

from ninfer.server.errors import APIError, error_body

# Bodies above this size are decoded and validated on a worker thread, so /health and small
# requests keep answering while a large body is processed.
LARGE_BODY_BYTES = 256 << 10


def request_id_of(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id", "")


def error_response(request: Request, error: APIError) -> Response:
    return Response(
        error_body(request.url.path, error, request_id_of(request)),
        status_code=error.status,
        media_type="application/json",
        headers=error.headers(),
    )


def _decode(raw: bytes) -> object:
    try:
        return json.loads(raw)  # keeps member order: tool schemas and arguments reach the prompt as sent
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc


async def read_json(request: Request) -> tuple[object, bool]:
    """The parsed body, and whether it is large (the caller then validates it off the loop too)."""
    raw = await request.body()
    if len(raw) < LARGE_BODY_BYTES:
        return _decode(raw), False
    return await asyncio.to_thread(_decode, raw), True
