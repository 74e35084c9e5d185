"""HTTP helpers every route uses: request ids, JSON bodies off the event loop, error responses."""

from __future__ import annotations

import asyncio
import json
import math
import re

from fastapi import Request
from fastapi.responses import Response

from ninfer.server.errors import APIError, error_body

# Bodies above this size are decoded and validated on a worker thread, so /health and small
# requests keep answering while a large body is processed.
LARGE_BODY_BYTES = 256 << 10
# Deeper than any real request (tool schemas nest a few levels); keeps the recursive steps after
# parsing (template rendering, deep copies, JSON encoding) far from Python's recursion limit.
MAX_JSON_DEPTH = 128
_SURROGATE = re.compile("[\ud800-\udfff]")


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
        # Strict UTF-8 (RFC 8259): json.loads(bytes) would also guess UTF-16/32 and let encoded surrogates through.
        text = raw.decode("utf-8")
        value = json.loads(text)  # keeps member order: tool schemas and arguments reach the prompt as sent
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8: {exc}", code="invalid_json") from exc
    except RecursionError as exc:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from exc
    except ValueError as exc:  # JSONDecodeError, or an integer literal past Python's 4300-digit conversion limit
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    _check_values(value)
    return value


def _check_values(value: object) -> None:
    """What json.loads lets through but no JSON value holds: NaN/Infinity (and 1e400, which overflows to
    infinity) and lone UTF-16 surrogates ("\\ud800"); and nesting deeper than MAX_JSON_DEPTH, which later
    recursive steps (templates, copies, serialization) would fail on. Iterative, so depth cannot overflow it."""
    stack: list[tuple[object, str, int]] = [(value, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, str):
            if not node.isascii() and _SURROGATE.search(node):
                raise _bad_value(path, "holds a lone UTF-16 surrogate, which is not a Unicode character")
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise _bad_value(path, "is NaN or infinite (or too large for a double), which JSON cannot carry")
        elif isinstance(node, (dict, list)):
            if depth == MAX_JSON_DEPTH:
                field = re.split(r"[.\[]", path, maxsplit=1)[0]  # the top-level field holding the nesting
                raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels (in {field or 'it'})",
                               code="invalid_json", param=field or None)
            if isinstance(node, dict):
                for key, item in node.items():
                    child = f"{path}.{key}" if path else key
                    if not key.isascii() and _SURROGATE.search(key):
                        named = key.encode("utf-8", "backslashreplace").decode()  # a path the log can write
                        raise _bad_value(f"{path}.{named}" if path else named, "is a name holding a lone UTF-16 "
                                         "surrogate, which is not a Unicode character")
                    stack.append((item, child, depth + 1))
            else:
                stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node))


def _bad_value(path: str, problem: str) -> APIError:
    where = path or "the request body"
    return APIError(400, f"{where} {problem}", code="invalid_value", param=path or None)


async def read_json(request: Request) -> tuple[object, bool]:
    """The parsed body, and whether it is large (the caller then validates it off the loop too)."""
    raw = await request.body()
    if len(raw) < LARGE_BODY_BYTES:
        return _decode(raw), False
    return await asyncio.to_thread(_decode, raw), True
