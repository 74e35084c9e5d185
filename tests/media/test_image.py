"""Image preparation against transformers' Qwen2-VL PIL image processor with Qwen3.5's settings."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from ninfer.media.errors import InvalidMedia, MediaBudgetExceeded
from ninfer.media.image import ImageSettings, plan_image, prepare_image
from ninfer.media.patches import resized_image_size
from tests.media.media_samples import image_bytes

pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: E402
    Qwen2VLImageProcessorPil,
    smart_resize,
)


def qwen_processor(longest_edge: int = 16777216) -> Qwen2VLImageProcessorPil:
    """transformers' processor with Qwen3.5's preprocessor_config values."""
    return Qwen2VLImageProcessorPil(
        size={"longest_edge": longest_edge, "shortest_edge": 65536},
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


@pytest.fixture(scope="module")
def reference():
    return qwen_processor()


@pytest.mark.parametrize(
    "width, height, mode, image_format",
    [
        (10, 7, "RGB", "PNG"),  # far below min pixels: scaled up
        (333, 517, "RGBA", "PNG"),  # alpha dropped by a plain RGB convert
        (640, 480, "P", "PNG"),  # palette
        (301, 207, "L", "PNG"),  # grayscale
        (1000, 6, "RGB", "PNG"),  # aspect ratio 166.7, near the 200 limit
        (7, 1380, "L", "JPEG"),  # aspect ratio 197
        (299, 1001, "RGB", "JPEG"),  # no side a multiple of 32
        pytest.param(4500, 4000, "RGB", "JPEG", marks=pytest.mark.slow),  # above max pixels: shrunk (13 s)
    ],
)
def test_patches_equal_transformers(reference, width, height, mode, image_format):
    data = image_bytes(width, height, mode, image_format)
    ours = prepare_image(data, ImageSettings())
    expected = reference(Image.open(io.BytesIO(data)), return_tensors="pt")
    assert list(ours.grid_thw) == expected["image_grid_thw"][0].tolist()
    assert ours.patches.dtype == torch.bfloat16
    assert ours.patches.shape == expected["pixel_values"].shape
    # Bit-exact: the reference's float32 values rounded to BF16 as torch casts them.
    assert torch.equal(ours.patches, expected["pixel_values"].to(torch.bfloat16))
    assert ours.timestamps_s is None


def test_shrink_path_equals_transformers_with_a_smaller_pixel_ceiling():
    # The shrink branch at full scale needs a >16 M pixel image (the slow case above); a lower
    # ceiling exercises the same arithmetic on a small one.
    data = image_bytes(900, 700, "RGB", "JPEG")
    small_ceiling = qwen_processor(longest_edge=200_000)
    ours = prepare_image(data, ImageSettings(max_pixels=200_000))
    expected = small_ceiling(Image.open(io.BytesIO(data)), return_tensors="pt")
    assert list(ours.grid_thw) == expected["image_grid_thw"][0].tolist()
    assert ours.grid_thw[1] * ours.grid_thw[2] * 256 <= 200_000
    assert torch.equal(ours.patches, expected["pixel_values"].to(torch.bfloat16))


def test_plan_matches_preparation_without_decoding():
    data = image_bytes(777, 333)
    plan = plan_image(data, ImageSettings())
    packed = prepare_image(data, ImageSettings())
    assert plan.grid_thw == packed.grid_thw
    assert plan.patch_rows == packed.patches.shape[0]
    assert plan.patch_bytes(ImageSettings().geometry) == packed.patches.numel() * 2
    assert plan.source_pixels == 777 * 333


@pytest.mark.parametrize("height, width", [(7, 10), (4000, 4500), (6, 1000), (32, 32), (48, 80), (16384, 82), (5000, 5000)])
def test_smart_resize_equals_transformers(height, width):
    ours = resized_image_size(height, width, 32, 65536, 16777216)
    assert ours == smart_resize(height, width, factor=32, min_pixels=65536, max_pixels=16777216)
    tokens = ours[0] * ours[1] // (32 * 32)
    assert 64 <= tokens <= 16384


def test_aspect_ratio_above_200_is_invalid():
    with pytest.raises(InvalidMedia) as caught:
        prepare_image(image_bytes(1005, 5), ImageSettings())
    assert caught.value.code == "invalid_media"


def test_undecodable_and_truncated_bytes_are_invalid():
    with pytest.raises(InvalidMedia):
        prepare_image(b"not an image at all", ImageSettings())
    whole = image_bytes(300, 200, image_format="JPEG")
    with pytest.raises(InvalidMedia):
        prepare_image(whole[: len(whole) // 2], ImageSettings())


def test_source_pixel_cap_refuses_before_decoding():
    data = image_bytes(400, 300)
    with pytest.raises(MediaBudgetExceeded) as caught:
        plan_image(data, ImageSettings(max_source_pixels=400 * 300 - 1))
    assert caught.value.code == "media_budget_exceeded"
    assert prepare_image(data, ImageSettings(max_source_pixels=400 * 300)).grid_thw == (1, 18, 24)


def test_animated_gif_contributes_its_first_frame():
    frames = [Image.new("RGB", (64, 64), color) for color in ((255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    first = io.BytesIO()
    frames[0].save(first, "PNG")
    assert torch.equal(prepare_image(buffer.getvalue(), ImageSettings()).patches, prepare_image(first.getvalue(), ImageSettings()).patches)
