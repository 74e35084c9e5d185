"""Video decoding (PyAV) and preparation, matching transformers' Qwen3-VL video processor.

Semantics kept from that processor: frames are sampled uniformly at `fps` per second of video
(clamped to [min_frames, max_frames] and to the frame count), the whole clip is resized with one
smart-resize size whose pixel bounds count every sampled frame, resizing is bicubic with antialias
in float32 then rounded back to uint8 (torchvision's tensor resize), an odd frame count repeats the
last frame, and each temporal group's timestamp is the mean of its first and last frame times.
The per-frame pixel cap (`cap_pixels_per_frame`) is off, as it is by default in transformers 5.17.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import av
import numpy as np
import torch
import torch.nn.functional as F

from ninfer.media.errors import InvalidMedia, MediaBudgetExceeded
from ninfer.media.patches import (
    PackedPatches,
    PatchGeometry,
    PatchPlan,
    pack_frames,
    resized_video_size,
    video_value_table,
)

# transformers assumes this rate when a container states none; we do the same for equal timestamps.
FALLBACK_FPS = 24.0


@dataclass(frozen=True)
class VideoSettings:
    """Qwen3.5's video_preprocessor_config: size {shortest_edge 4096, longest_edge 25165824}."""

    min_pixels: int = 4096
    max_pixels: int = 25165824  # over all sampled frames together
    sample_fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    image_mean: float = 0.5
    image_std: float = 0.5
    geometry: PatchGeometry = field(default_factory=PatchGeometry)
    max_frame_pixels: int = 64 * 1024 * 1024  # decompression guard per source frame
    max_source_frames: int = 108_000  # frames decoded to reach the last sample (an hour at 30 fps)


@dataclass(frozen=True)
class VideoPlan:
    patch_plan: PatchPlan
    frame_indices: tuple[int, ...]  # source frames sampled, ascending
    source_fps: float
    timestamps_s: tuple[float, ...]  # one per temporal group


def sample_frame_indices(total_frames: int, source_fps: float, settings: VideoSettings) -> list[int]:
    wanted = int(total_frames / source_fps * settings.sample_fps)
    count = min(max(wanted, settings.min_frames), settings.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, count).round().astype(int).tolist()


def group_timestamps(frame_indices: list[int], source_fps: float, frames_per_group: int) -> tuple[float, ...]:
    """Seconds per temporal group: mean of the group's first and last frame times (last frame repeats)."""
    padded = list(frame_indices)
    while len(padded) % frames_per_group:
        padded.append(padded[-1])
    times = [index / source_fps for index in padded]
    return tuple((times[i] + times[i + frames_per_group - 1]) / 2 for i in range(0, len(times), frames_per_group))


def _open(data: bytes) -> tuple[av.container.InputContainer, av.video.stream.VideoStream]:
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError, OSError) as error:
        raise InvalidMedia(f"bytes are not a decodable video ({type(error).__name__})") from None
    if not container.streams.video:
        container.close()
        raise InvalidMedia("container has no video stream")
    return container, container.streams.video[0]


def _count_frames(container: av.container.InputContainer, stream: av.video.stream.VideoStream, limit: int) -> int:
    """Frame count from packets when the header states none (streams such as WebM/Matroska)."""
    count = 0
    for packet in container.demux(stream):
        if packet.size:
            count += 1
            if count > limit:
                break
    container.seek(0)
    return count


def _plan(container, stream, settings: VideoSettings) -> VideoPlan:
    width, height = stream.codec_context.width, stream.codec_context.height
    if width < 1 or height < 1:
        raise InvalidMedia("video has no frame size")
    if width * height > settings.max_frame_pixels:
        raise MediaBudgetExceeded(f"video frames have {width}x{height} pixels, above {settings.max_frame_pixels}")
    total_frames = stream.frames if stream.frames > 0 else _count_frames(container, stream, settings.max_source_frames)
    if total_frames > settings.max_source_frames:
        raise MediaBudgetExceeded(f"video has more than {settings.max_source_frames} frames")
    if total_frames < 1:
        raise InvalidMedia("video has no frames")
    source_fps = float(stream.average_rate) if stream.average_rate else FALLBACK_FPS
    indices = sample_frame_indices(total_frames, source_fps, settings)
    geometry = settings.geometry
    resized_height, resized_width = resized_video_size(
        len(indices),
        height,
        width,
        geometry.resize_factor,
        geometry.temporal_patch_size,
        settings.min_pixels,
        settings.max_pixels,
    )
    groups = -(-len(indices) // geometry.temporal_patch_size)
    grid = (groups, resized_height // geometry.patch_size, resized_width // geometry.patch_size)
    plan = PatchPlan(grid, len(indices) * height * width, resized_height, resized_width)
    timestamps = group_timestamps(indices, source_fps, geometry.temporal_patch_size)
    return VideoPlan(plan, tuple(indices), source_fps, timestamps)


def plan_video(data: bytes, settings: VideoSettings) -> VideoPlan:
    """Read the container header (and packets, if it states no frame count); decode no frame."""
    container, stream = _open(data)
    try:
        return _plan(container, stream, settings)
    except av.error.FFmpegError as error:
        raise InvalidMedia(f"video container is unreadable ({type(error).__name__})") from None
    finally:
        container.close()


def resize_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bicubic antialiased resize in float32, clamped and rounded to uint8 (torchvision's uint8 path)."""
    if frame.shape[:2] == (height, width):
        return frame
    planar = torch.from_numpy(frame).permute(2, 0, 1)[None].to(torch.float32)
    resized = F.interpolate(planar, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return resized.clamp_(0, 255).round_().to(torch.uint8)[0].permute(1, 2, 0).numpy()


class PreparationStopped(Exception):
    """Nobody wants the result any more (every interested request was cancelled)."""


def prepare_video(data: bytes, settings: VideoSettings, keep_going=lambda: True) -> PackedPatches:
    """Decode the sampled frames, resize each as it arrives, pad to whole temporal groups and pack.

    `keep_going()` is asked once per decoded frame, so an abandoned long video stops early.
    """
    container, stream = _open(data)
    try:
        video_plan = _plan(container, stream, settings)
        plan = video_plan.patch_plan
        wanted = set(video_plan.frame_indices)
        last_index = video_plan.frame_indices[-1]
        frames: list[np.ndarray] = []
        for index, frame in enumerate(container.decode(stream)):
            if not keep_going():
                raise PreparationStopped()
            if index in wanted:
                frames.append(resize_frame(frame.to_ndarray(format="rgb24"), plan.resized_height, plan.resized_width))
            if index >= last_index:
                break
    except av.error.FFmpegError as error:
        raise InvalidMedia(f"video frames failed to decode ({type(error).__name__})") from None
    finally:
        container.close()
    if len(frames) != len(video_plan.frame_indices):
        raise InvalidMedia(f"video ended after {len(frames)} of {len(video_plan.frame_indices)} sampled frames")
    temporal = settings.geometry.temporal_patch_size
    while len(frames) % temporal:
        frames.append(frames[-1])
    table = video_value_table(settings.image_mean, settings.image_std)
    patches = pack_frames(np.stack(frames), table, settings.geometry)
    return PackedPatches(patches, plan.grid_thw, video_plan.timestamps_s)
