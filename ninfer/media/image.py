"""Image decoding (Pillow) and preparation, matching transformers' Qwen2-VL PIL image processor.

Like that processor: the image is converted to RGB with Pillow's plain convert (alpha is dropped,
not composited), EXIF orientation is not applied, and an animated image contributes its first frame.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from ninfer.media.errors import InvalidMedia, MediaBudgetExceeded
from ninfer.media.patches import (
    PackedPatches,
    PatchGeometry,
    PatchPlan,
    image_value_table,
    pack_frames,
    resized_image_size,
)

# Formats Pillow may decode for us; the rest (EPS runs Ghostscript, exotic ones see little use) are refused.
ALLOWED_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


@dataclass(frozen=True)
class ImageSettings:
    """Qwen3.5's preprocessor_config: size {shortest_edge 65536, longest_edge 16777216}, mean/std 0.5."""

    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: float = 0.5
    image_std: float = 0.5
    geometry: PatchGeometry = field(default_factory=PatchGeometry)
    # Decompression-bomb guard on the source size, checked from the header before decoding; kept under
    # Pillow's own warning threshold (about 89 M pixels) so Pillow never has to intervene.
    max_source_pixels: int = 64 * 1024 * 1024


def _open(data: bytes, settings: ImageSettings) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ALLOWED_IMAGE_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaBudgetExceeded("image has more pixels than the decoder allows") from None
    except (OSError, SyntaxError, ValueError) as error:
        raise InvalidMedia(f"bytes are not a decodable image ({type(error).__name__})") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise InvalidMedia("image has no pixels")
    if width * height > settings.max_source_pixels:
        raise MediaBudgetExceeded(f"image has {width}x{height} pixels, above {settings.max_source_pixels}")
    return image


def _plan(height: int, width: int, settings: ImageSettings) -> PatchPlan:
    geometry = settings.geometry
    resized_height, resized_width = resized_image_size(
        height, width, geometry.resize_factor, settings.min_pixels, settings.max_pixels
    )
    grid = (1, resized_height // geometry.patch_size, resized_width // geometry.patch_size)
    return PatchPlan(grid, height * width, resized_height, resized_width)


def plan_image(data: bytes, settings: ImageSettings) -> PatchPlan:
    """Read the header only: the grid and payload size the image will have once prepared."""
    image = _open(data, settings)
    return _plan(image.height, image.width, settings)


def prepare_image(data: bytes, settings: ImageSettings) -> PackedPatches:
    """Decode, convert to RGB, bicubic smart resize, normalize and pack into BF16 rows."""
    image = _open(data, settings)
    plan = _plan(image.height, image.width, settings)
    try:
        image.load()
        if image.mode != "RGB":
            image = image.convert("RGB")
        resized = image.resize((plan.resized_width, plan.resized_height), resample=Image.Resampling.BICUBIC)
    except (OSError, SyntaxError, ValueError) as error:
        raise InvalidMedia(f"image bytes failed to decode ({type(error).__name__})") from None
    pixels = np.asarray(resized, dtype=np.uint8)[None]
    table = image_value_table(settings.image_mean, settings.image_std)
    return PackedPatches(pack_frames(pixels, table, settings.geometry), plan.grid_thw, None)
