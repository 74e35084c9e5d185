"""Image and video parts, shared by the three protocols: source checks and the vision switch."""

from __future__ import annotations

from typing import Literal

from ninfer.frontend.conversation import MediaPart
from ninfer.server.errors import APIError, invalid
from ninfer.server.validation.fields import cannot_provide
from ninfer.server.validation.schema import Schema

MEDIA_SCHEMES = ("http://", "https://", "data:")
IMAGE_DETAILS = ("auto", "low", "high", "original")
# A media source in the OpenAPI document: one of MEDIA_SCHEMES, in any letter case.
MEDIA_URL: Schema = {
    "type": "string",
    "pattern": "^(" + "|".join("".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in scheme)
                               for scheme in MEDIA_SCHEMES) + ")",
    "description": "an http(s) URL (fetched under the server's address rules) or a data: URI",
}


def check_detail(detail: str | None, path: str) -> None:
    if detail is not None and detail not in IMAGE_DETAILS:
        raise invalid(path, f"{path} must be one of {', '.join(IMAGE_DETAILS)}, got {detail!r}")
    if detail not in (None, "auto"):
        raise cannot_provide(path, f"explicit {detail} image detail (only auto)")


def media_part(
    kind: Literal["image", "video"],
    url: str,
    part_path: str,
    url_path: str,
    vision_enabled: bool,
    cache_breakpoint: bool = False,
) -> MediaPart:
    """A validated media source; vision_disabled (naming the part) when this server takes no media."""
    if not url.lower().startswith(MEDIA_SCHEMES):
        raise invalid(url_path, f"{url_path} must be an http(s) URL or a data: URI", code="invalid_media")
    if not vision_enabled:
        raise vision_disabled(part_path)
    return MediaPart(kind=kind, url=url, cache_breakpoint=cache_breakpoint, path=url_path)


def vision_disabled(path: str) -> APIError:
    return APIError(
        400,
        f"{path}: this server does not accept image or video input (vision is not enabled)",
        code="vision_disabled",
        param=path,
    )
