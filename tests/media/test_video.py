"""Video preparation against transformers' Qwen3-VL video pieces with Qwen3.5's settings.

transformers' Qwen3VLVideoProcessor cannot be constructed here: it needs torchvision, and no
torchvision wheel on PyPI loads with the CPU torch build. The reference is therefore assembled
from transformers' own functions: read_video_pyav (decode), Qwen3VLVideoProcessor.sample_frames,
the module's smart_resize, Qwen3VLVideoProcessor.patchify and Qwen3VLProcessor._calculate_timestamps.
Only the resize and the fused normalize are written out, as torchvision's uint8 bicubic path
(float32 antialiased interpolate, clamp, round) and BaseVideoProcessor's mean·255 / std·255 step.
"""

from __future__ import annotations

import types

import pytest
import torch

from ninfer.media.errors import InvalidMedia, MediaBudgetExceeded
from ninfer.media.video import VideoSettings, group_timestamps, plan_video, prepare_video
from tests.media.media_samples import video_bytes

pytest.importorskip("transformers")
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor  # noqa: E402
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize  # noqa: E402
from transformers.video_utils import read_video_pyav  # noqa: E402


def reference_video(path, height, width):
    defaults = types.SimpleNamespace(fps=2, min_frames=4, max_frames=768)
    frames, metadata = read_video_pyav(
        str(path), sample_indices_fn=lambda metadata, **_: Qwen3VLVideoProcessor.sample_frames(defaults, metadata)
    )
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).float()
    resized_height, resized_width = smart_resize(
        len(frames), height, width, temporal_factor=2, factor=32, min_pixels=4096, max_pixels=25165824
    )
    if (resized_height, resized_width) != (height, width):
        video = torch.nn.functional.interpolate(
            video, size=[resized_height, resized_width], mode="bicubic", align_corners=False, antialias=True
        )
        video = video.clamp_(0, 255).round_()
    mean = torch.tensor([0.5] * 3) * (1.0 / (1 / 255))
    std = torch.tensor([0.5] * 3) * (1.0 / (1 / 255))
    video = ((video - mean[:, None, None]) / std[:, None, None])[None]
    patches, grid_t, grid_h, grid_w = Qwen3VLVideoProcessor.patchify(None, video, 16, 2, 2)
    timestamps = Qwen3VLProcessor._calculate_timestamps(None, list(metadata.frames_indices), metadata.fps, 2)
    return patches[0], (grid_t, grid_h, grid_w), [float(t) for t in timestamps], list(metadata.frames_indices)


@pytest.mark.parametrize(
    "width, height, fps, frame_count, codec",
    [
        (64, 48, 10, 30, "libx264"),  # 3 s at 10 fps: 6 sampled frames, upscaled to 64×64
        (50, 20, 10, 25, "libx264"),  # 5 sampled frames (odd: the last repeats), short side below 32
        (200, 120, 25, 20, "mpeg4"),  # fewer frames than min_frames·fps: 4 sampled, downsized to 192×128
    ],
)
def test_patches_and_timestamps_equal_transformers(tmp_path, width, height, fps, frame_count, codec):
    data = video_bytes(width, height, fps, frame_count, codec)
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    expected_patches, expected_grid, expected_times, expected_indices = reference_video(path, height, width)
    plan = plan_video(data, VideoSettings())
    assert list(plan.frame_indices) == expected_indices
    ours = prepare_video(data, VideoSettings())
    assert ours.grid_thw == expected_grid
    assert ours.patches.dtype == torch.bfloat16
    assert torch.equal(ours.patches, expected_patches.to(torch.bfloat16))
    assert ours.timestamps_s == pytest.approx(expected_times, abs=1e-12)
    assert len(ours.timestamps_s) == ours.grid_thw[0]


def test_first_clip_samples_and_times():
    # 30 frames at 10 fps, 2 samples a second: frames 0 6 12 17 23 29, groups at 0.3 1.45 2.6 s.
    ours = prepare_video(video_bytes(64, 48, 10, 30), VideoSettings())
    assert ours.grid_thw == (3, 4, 4)
    assert ours.timestamps_s == pytest.approx((0.3, 1.45, 2.6))


def test_webm_without_frame_count_is_counted_from_packets():
    data = video_bytes(64, 48, 10, 30, codec="libvpx-vp9", container="webm")
    plan = plan_video(data, VideoSettings())
    assert list(plan.frame_indices) == [0, 6, 12, 17, 23, 29]
    assert prepare_video(data, VideoSettings()).grid_thw == (3, 4, 4)


def test_group_timestamps_pad_odd_counts_with_the_last_frame():
    assert group_timestamps([0, 5, 10], 10.0, 2) == (0.25, 1.0)


def test_single_frame_video_is_invalid():
    with pytest.raises(InvalidMedia):
        prepare_video(video_bytes(64, 48, 10, 1), VideoSettings())


def test_garbage_bytes_are_invalid():
    with pytest.raises(InvalidMedia) as caught:
        plan_video(b"\x00\x01 definitely not a container", VideoSettings())
    assert caught.value.code == "invalid_media"


def test_frame_pixel_cap_is_a_budget_error():
    with pytest.raises(MediaBudgetExceeded):
        plan_video(video_bytes(64, 48, 10, 4), VideoSettings(max_frame_pixels=64 * 48 - 1))


def test_abandoned_video_stops_decoding():
    from ninfer.media.video import PreparationStopped

    with pytest.raises(PreparationStopped):
        prepare_video(video_bytes(64, 48, 10, 30), VideoSettings(), keep_going=lambda: False)
