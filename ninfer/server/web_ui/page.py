"""The chat page: `/` and its files under `/ui/`, served as shipped in this package.

They need no API key (they hold no secret; the page asks for the key its API calls carry), and a
Content-Security-Policy keeps the page to this server: no script, style, image or connection from
anywhere else, so model output that slipped past the page's escaping could neither run nor call out.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

ASSETS_PREFIX = "/ui/"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data: blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    # Revalidated on every load, so an upgraded server never runs with a cached older page.
    "cache-control": "no-cache",
}


def files() -> dict[str, tuple[bytes, str]]:
    """URL path -> (body, content type) for every shipped file: index.html at `/`, the rest under /ui/,
    and the icon at /favicon.ico too, where browsers look for it on pages that name none."""
    served = {}
    for entry in resources.files(__package__).iterdir():
        suffix = entry.name[entry.name.rfind("."):]
        if entry.is_file() and suffix in CONTENT_TYPES:
            path = "/" if entry.name == "index.html" else ASSETS_PREFIX + entry.name
            served[path] = (entry.read_bytes(), CONTENT_TYPES[suffix])
    served["/favicon.ico"] = served[ASSETS_PREFIX + "icon.svg"]
    return served


def register(app: FastAPI) -> tuple[str, ...]:
    """Add the page's routes (plain routes: not part of the API or its OpenAPI document); returns their paths."""
    served = files()
    for path, (body, content_type) in served.items():

        async def serve_file(request: Request, body: bytes = body, content_type: str = content_type) -> Response:
            return Response(body, media_type=content_type, headers=HEADERS)

        app.add_route(path, serve_file, methods=["GET"], include_in_schema=False)
    return tuple(served)
