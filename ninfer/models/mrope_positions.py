"""Three-axis (t, h, w) MRoPE positions of a Qwen3.5-family prompt holding images and videos.

Text tokens take one running position on all three axes. An image, or one temporal step of a
video (the processor puts each step's placeholders in its own run, after a timestamp), is a
block of frames x rows x cols merged tokens placed at the running position `base`:
t = base + frame, h = base + row, w = base + col; the running position then advances by
max(rows, cols), so the text after a block resumes past its widest axis.

A prompt's layout is built once (MropeLayout); any token range's positions come from it, so a
chunk of a chunked prefill, or the suffix after a reused prefix, gets exactly the slice of the
whole prompt's positions. Tokens past the prompt (decode) sit at index + rope_delta on all axes.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer.models.vision_config import IMAGE_TOKEN_ID, VIDEO_TOKEN_ID

IMAGE = "image"
VIDEO = "video"


@dataclass(frozen=True)
class MediaPlacement:
    """One image or video of a prompt, as the vision tower sees it."""

    modality: str  # IMAGE or VIDEO (a str Enum of those values, e.g. ninfer.media.Modality, works too)
    grid_thw: tuple[int, int, int]  # the tower's patch grid (temporal steps, patch rows, patch columns)
    start: int  # prompt index of its first placeholder token (a video's: its first step's)


@dataclass(frozen=True)
class PlaceholderBlock:
    """One contiguous run of placeholders: an image, or one temporal step of a video."""

    start: int  # prompt index of its first token
    base: int  # the running position when it begins: its first token's position on every axis
    frames: int
    rows: int  # merged-token rows (patch rows / spatial_merge_size)
    cols: int

    @property
    def end(self) -> int:
        return self.start + self.frames * self.rows * self.cols

    @property
    def advance(self) -> int:
        """How far the running position moves past this block."""
        return max(self.rows, self.cols)


def text_positions(start: int, end: int, rope_delta: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """[3, end - start] int64: tokens start..end-1 as text, at index + rope_delta on every axis
    (decode steps after a prompt: start = tokens already cached)."""
    return (torch.arange(start, end, device=device) + rope_delta).expand(3, -1).clone()


@dataclass(frozen=True)
class MropeLayout:
    num_tokens: int  # the prompt's length
    rope_delta: int  # largest prompt position + 1 - num_tokens: added to decode indices
    blocks: tuple[PlaceholderBlock, ...]  # in prompt order
    # position - index of the text before block i (text_offsets[i]) and after the last block (the last entry)
    text_offsets: tuple[int, ...]

    def positions(self, start: int = 0, end: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """[3, end - start] int64 (t, h, w) positions of tokens start..end-1; end defaults to the
        prompt's length and may run past it (those tokens continue as text after the prompt)."""
        end = self.num_tokens if end is None else end
        if not 0 <= start <= end:
            raise ValueError(f"token range [{start}, {end}) is not a range of token indices")
        index = torch.arange(start, end)
        starts = [block.start for block in self.blocks]
        # Text offset of each token: the one after the last block starting at or before it.
        region = torch.searchsorted(torch.tensor(starts, dtype=torch.long), index, right=True)
        offsets = torch.tensor(self.text_offsets, dtype=torch.long)[region]
        past_prompt = index >= self.num_tokens
        offsets[past_prompt] = self.rope_delta
        out = (index + offsets).expand(3, -1).clone()
        first = max(bisect.bisect_right(starts, start) - 1, 0)
        for block in self.blocks[first:]:
            if block.start >= end:
                break
            lo, hi = max(block.start, start), min(block.end, end)
            if lo >= hi:
                continue
            within = torch.arange(lo - block.start, hi - block.start)
            plane = block.rows * block.cols
            out[0, lo - start : hi - start] = block.base + within // plane
            out[1, lo - start : hi - start] = block.base + (within % plane) // block.cols
            out[2, lo - start : hi - start] = block.base + within % block.cols
        return out.to(device) if device is not None else out


def build_mrope_layout(
    token_ids: Sequence[int] | torch.Tensor,
    media: Sequence[MediaPlacement],
    *,
    spatial_merge_size: int = 2,
    image_token_id: int = IMAGE_TOKEN_ID,
    video_token_id: int = VIDEO_TOKEN_ID,
) -> MropeLayout:
    """The layout of a prompt whose placeholder runs `media` describes.

    ValueError when a placement does not sit on a run of its own placeholder tokens of the size
    its grid implies, when placements overlap, or when a placeholder token belongs to none."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().cpu()
    num_tokens = ids.numel()
    merge = spatial_merge_size
    runs: list[tuple[int, int, int, int]] = []  # (start, frames, rows, cols) of each block
    pad_indices = {
        IMAGE: (ids == image_token_id).nonzero().flatten(),
        VIDEO: (ids == video_token_id).nonzero().flatten(),
    }
    covered = {IMAGE: 0, VIDEO: 0}
    for item in media:
        modality = item.modality
        if modality not in pad_indices:
            raise ValueError(f"media modality {item.modality!r} is not {IMAGE!r} or {VIDEO!r}")
        t, h, w = (int(v) for v in item.grid_thw)
        if t < 1 or h < merge or w < merge or h % merge or w % merge:
            raise ValueError(f"{modality} grid {item.grid_thw}: h and w must be positive multiples of {merge}")
        rows, cols = h // merge, w // merge
        # An image is one block of t frames; a video is t one-frame blocks, one per placeholder run.
        frames, steps = (t, 1) if modality == IMAGE else (1, t)
        run_length = frames * rows * cols
        indices = pad_indices[modality]
        first = int(torch.searchsorted(indices, item.start))
        for step in range(steps):
            run = indices[first + step * run_length : first + (step + 1) * run_length]
            where = f"{modality} at token {item.start}" + (f" (step {step} of {steps})" if steps > 1 else "")
            if step == 0 and (run.numel() == 0 or int(run[0]) != item.start):
                raise ValueError(f"{where}: token {item.start} is not a {modality} placeholder")
            if run.numel() < run_length:
                raise ValueError(f"{where}: needs {run_length} placeholder tokens, the prompt has {run.numel()} left")
            if int(run[-1]) - int(run[0]) != run_length - 1:
                raise ValueError(f"{where}: its {run_length} placeholder tokens are not one run from {int(run[0])}")
            runs.append((int(run[0]), frames, rows, cols))
        covered[modality] += steps * run_length
    for modality, indices in pad_indices.items():
        if covered[modality] != indices.numel():
            raise ValueError(
                f"the prompt holds {indices.numel()} {modality} placeholder tokens; the media placements cover {covered[modality]}"
            )

    runs.sort()
    blocks: list[PlaceholderBlock] = []
    text_offsets = [0]
    previous_end = 0
    max_position = -1
    for start, frames, rows, cols in runs:
        if start < previous_end:
            raise ValueError(f"media placeholder runs overlap at token {start}")
        if start > previous_end:  # the text before this block
            max_position = max(max_position, start - 1 + text_offsets[-1])
        block = PlaceholderBlock(start=start, base=start + text_offsets[-1], frames=frames, rows=rows, cols=cols)
        blocks.append(block)
        max_position = max(max_position, block.base + max(frames, rows, cols) - 1)
        text_offsets.append(block.base + block.advance - block.end)
        previous_end = block.end
    if num_tokens > previous_end:
        max_position = max(max_position, num_tokens - 1 + text_offsets[-1])
    return MropeLayout(
        num_tokens=num_tokens,
        rope_delta=max_position + 1 - num_tokens,
        blocks=tuple(blocks),
        text_offsets=tuple(text_offsets),
    )


def mrope_positions(
    token_ids: Sequence[int] | torch.Tensor,
    media: Sequence[MediaPlacement],
    *,
    spatial_merge_size: int = 2,
    image_token_id: int = IMAGE_TOKEN_ID,
    video_token_id: int = VIDEO_TOKEN_ID,
) -> tuple[torch.Tensor, int]:
    """The whole prompt's [3, T] int64 positions and its rope delta."""
    layout = build_mrope_layout(
        token_ids,
        media,
        spatial_merge_size=spatial_merge_size,
        image_token_id=image_token_id,
        video_token_id=video_token_id,
    )
    return layout.positions(), layout.rope_delta
