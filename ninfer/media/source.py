"""Media acquisition: the bytes behind an OpenAI image or video source (a data URL or an HTTP(S) URL)."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from enum import Enum

from ninfer.media.errors import InvalidMedia, MediaBudgetExceeded
from ninfer.media.fetch import FetchPolicy, Resolver, fetch_media


class Modality(str, Enum):
    IMAGE = "image"
    VIDEO = "video"


@dataclass(frozen=True)
class AcquiredMedia:
    modality: Modality
    data: bytes
    media_type: str | None  # the data URL's declared type; None for fetched bytes


def parse_data_url(url: str, modality: Modality, max_bytes: int) -> AcquiredMedia:
    """`data:<type>/<subtype>[;params];base64,<payload>` whose type is the modality's (image/*, video/*)."""
    header, comma, payload = url.partition(",")
    if not comma or not header[:5].lower() == "data:":
        raise InvalidMedia("data URL has no ',' separating header and payload")
    params = [part.strip() for part in header[5:].split(";")]
    media_type = params[0].lower()
    if "base64" not in (param.lower() for param in params[1:]):
        raise InvalidMedia("data URL must be base64-encoded")
    if not media_type.startswith(f"{modality.value}/") or len(media_type) == len(modality.value) + 1:
        raise InvalidMedia(f"data URL media type {media_type or '(none)'!r} is not {modality.value}/*")
    # Checked before decoding so an oversized payload is never materialised.
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise MediaBudgetExceeded(f"media is larger than the {max_bytes}-byte limit")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidMedia("data URL payload is not valid base64") from None
    if not data:
        raise InvalidMedia("data URL payload is empty")
    if len(data) > max_bytes:
        raise MediaBudgetExceeded(f"media is {len(data)} bytes, above the {max_bytes}-byte limit")
    return AcquiredMedia(modality, data, media_type)


async def acquire_media(
    url: str, modality: Modality, policy: FetchPolicy, resolver: Resolver | None = None
) -> AcquiredMedia:
    """Bytes of a data URL, or of an http(s) URL fetched under `policy`. Raises MediaError subclasses."""
    scheme = url[: url.find(":")].strip().lower() if ":" in url else ""
    if scheme == "data":
        return parse_data_url(url, modality, policy.max_bytes)
    if scheme in ("http", "https"):
        return AcquiredMedia(modality, await fetch_media(url, policy, resolver), None)
    raise InvalidMedia("media source must be an http(s) URL or a base64 data URL")
