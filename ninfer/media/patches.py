"""Patch geometry, smart resize and BF16 patch packing shared by images and videos.

Rows are what the Qwen3.5 vision tower consumes: each holds channel × temporal × patch × patch
values (3·2·16·16 = 1536), and the rows of one merge group (merge × merge neighbouring patches)
are consecutive, so the tower's patch merger can take them as one block.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from ninfer.media.errors import InvalidMedia

# The processors refuse images whose long side exceeds this many times the short side.
MAX_ASPECT_RATIO = 200
RGB_CHANNELS = 3


@dataclass(frozen=True)
class PatchGeometry:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2

    @property
    def resize_factor(self) -> int:
        """Side lengths are multiples of this so a merge group tiles the frame exactly."""
        return self.patch_size * self.merge_size

    @property
    def values_per_row(self) -> int:
        return RGB_CHANNELS * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def patches_per_token(self) -> int:
        return self.merge_size * self.merge_size


def _check_aspect_ratio(height: int, width: int) -> None:
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidMedia(f"aspect ratio {max(height, width) / min(height, width):.1f} exceeds {MAX_ASPECT_RATIO}")


def resized_image_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL image smart resize: sides to multiples of factor, area within [min, max] pixels."""
    _check_aspect_ratio(height, width)
    resized_height = round(height / factor) * factor
    resized_width = round(width / factor) * factor
    if resized_height * resized_width > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        resized_height = max(factor, math.floor(height / shrink / factor) * factor)
        resized_width = max(factor, math.floor(width / shrink / factor) * factor)
    elif resized_height * resized_width < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        resized_height = math.ceil(height * grow / factor) * factor
        resized_width = math.ceil(width * grow / factor) * factor
    return resized_height, resized_width


def resized_video_size(
    frame_count: int, height: int, width: int, factor: int, temporal_factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen3-VL video smart resize: like the image one, but the pixel bounds count all sampled frames.

    Frames thinner than one factor are first scaled up (truncating) so the short side reaches it.
    """
    if frame_count < temporal_factor:
        raise InvalidMedia(f"a video needs at least {temporal_factor} frames, got {frame_count}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    _check_aspect_ratio(height, width)
    resized_height = round(height / factor) * factor
    resized_width = round(width / factor) * factor
    rounded_frames = round(frame_count / temporal_factor) * temporal_factor
    if rounded_frames * resized_height * resized_width > max_pixels:
        shrink = math.sqrt(frame_count * height * width / max_pixels)
        resized_height = max(factor, math.floor(height / shrink / factor) * factor)
        resized_width = max(factor, math.floor(width / shrink / factor) * factor)
    elif rounded_frames * resized_height * resized_width < min_pixels:
        grow = math.sqrt(min_pixels / (frame_count * height * width))
        resized_height = math.ceil(height * grow / factor) * factor
        resized_width = math.ceil(width * grow / factor) * factor
    return resized_height, resized_width


def _bf16_bits(values: torch.Tensor) -> np.ndarray:
    """float32 → BF16 (round to nearest even, as torch casts) as raw uint16 bit patterns."""
    return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


@functools.lru_cache(maxsize=8)
def image_value_table(mean: float, std: float) -> np.ndarray:
    """BF16 bits per uint8 level for the image processor: rescale in float64, then normalize in float32.

    A table keeps the output bit-identical to that operation order at a gather's cost.
    """
    levels = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
    normalized = (levels - np.float32(mean)) / np.float32(std)
    return _bf16_bits(torch.from_numpy(normalized))


@functools.lru_cache(maxsize=8)
def video_value_table(mean: float, std: float) -> np.ndarray:
    """BF16 bits per uint8 level for the video processor, which folds the 1/255 rescale into mean and std."""
    scale = 1.0 / (1 / 255)
    mean_level = torch.tensor(mean, dtype=torch.float32) * scale
    std_level = torch.tensor(std, dtype=torch.float32) * scale
    levels = torch.arange(256, dtype=torch.float32)
    return _bf16_bits((levels - mean_level) / std_level)


def pack_frames(frames: np.ndarray, value_table: np.ndarray, geometry: PatchGeometry) -> torch.Tensor:
    """Pack uint8 RGB frames [T, H, W, 3] into BF16 rows [T/tp · H/p · W/p, 1536].

    T is 1 (an image, repeated over the temporal patch) or a multiple of the temporal patch. Within a
    row the order is channel, time, patch row, patch column; rows run over time, merge-group row,
    merge-group column, then the merge group's own 2×2 positions.
    """
    frame_count, height, width, channels = frames.shape
    patch, merge, temporal = geometry.patch_size, geometry.merge_size, geometry.temporal_patch_size
    if channels != RGB_CHANNELS or height % (patch * merge) or width % (patch * merge):
        raise ValueError(f"frames {frames.shape} do not tile into {patch * merge}-pixel merge groups")
    bits = value_table[frames]
    if frame_count == 1:
        bits = np.broadcast_to(bits, (temporal, height, width, channels))
        frame_count = temporal
    if frame_count % temporal:
        raise ValueError(f"{frame_count} frames are not a multiple of the temporal patch {temporal}")
    temporal_groups = frame_count // temporal
    grid_height, grid_width = height // patch, width // patch
    blocks = bits.reshape(
        temporal_groups, temporal, grid_height // merge, merge, patch, grid_width // merge, merge, patch, channels
    )
    # → [t-group, merge row, merge col, in-group row, in-group col, channel, time, pixel row, pixel col]
    ordered = np.ascontiguousarray(blocks.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7))
    rows = ordered.reshape(temporal_groups * grid_height * grid_width, geometry.values_per_row)
    return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)


@dataclass(frozen=True)
class PatchPlan:
    """What one item will become, known from its header before any pixel is decoded."""

    grid_thw: tuple[int, int, int]  # temporal groups, patch rows, patch columns
    source_pixels: int  # decoded pixels before resize, over all sampled frames
    resized_height: int
    resized_width: int

    @property
    def patch_rows(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    def vision_tokens(self, geometry: PatchGeometry) -> int:
        return self.patch_rows // geometry.patches_per_token

    def patch_bytes(self, geometry: PatchGeometry) -> int:
        return self.patch_rows * geometry.values_per_row * 2  # BF16


@dataclass(frozen=True)
class PackedPatches:
    patches: torch.Tensor  # BF16 [patch rows, values per row]
    grid_thw: tuple[int, int, int]
    timestamps_s: tuple[float, ...] | None  # per temporal group (videos only)
