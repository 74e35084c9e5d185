"""Media made in the tests with Pillow and PyAV, plus the reference processors' settings."""

from __future__ import annotations

import io

import av
import numpy as np
from PIL import Image


def image_bytes(width: int, height: int, mode: str = "RGB", image_format: str = "PNG", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    # A gradient plus noise: resizing must interpolate real structure, not a flat field.
    ramp = np.linspace(0, 200, width, dtype=np.float64)[None, :, None] + np.linspace(0, 50, height)[:, None, None]
    rgba = np.clip(ramp + rng.integers(0, 56, (height, width, 4)), 0, 255).astype(np.uint8)
    image = Image.fromarray(rgba, "RGBA")
    if mode == "P":
        image = image.convert("RGB").quantize(colors=64)
    elif mode != "RGBA":
        image = image.convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, image_format)
    return buffer.getvalue()


def video_bytes(width: int, height: int, fps: int, frame_count: int, codec: str = "libx264", container: str = "mp4") -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as output:
        stream = output.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        rng = np.random.default_rng(frame_count)
        for index in range(frame_count):
            frame = np.zeros((height, width, 3), np.uint8)
            frame[..., 0] = (index * 7) % 256  # frames differ, so a wrong sample index shows
            frame[:, : width // 2, 1] = 200
            frame += rng.integers(0, 40, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return buffer.getvalue()
