"""MediaExpansion: a rendered prompt's media placeholders become each item's tokens.

The chat template writes `<|vision_start|><|image_pad|><|vision_end|>` per image and
`<|vision_start|><|video_pad|><|vision_end|>` per video. Once an item is prepared its grid
says how many tokens it takes: an image's pad becomes grid_h * grid_w / 4 pads; a video's
whole triple becomes, per temporal patch, its time stamp as text and a block of pads
(`<1.5 seconds><|vision_start|><|video_pad|>...<|vision_end|>`), as Qwen's own processor
lays videos out. Capture frontiers after an item move by the tokens it added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch

from ninfer.contract.media import SPATIAL_MERGE, MediaInput
from ninfer.contract.request import CaptureHint
from ninfer.frontend.prompt_builder import PreparedPrompt, PromptError


class PreparedItem(Protocol):
    """What expansion reads of a prepared image or video (the media package's PreparedMedia)."""

    modality: str
    sha256: str
    grid_thw: tuple[int, int, int]
    patches: torch.Tensor  # bf16 [t * h * w, 1536]
    timestamps_s: Sequence[float] | None  # video: seconds of each temporal patch


@dataclasses.dataclass(frozen=True)
class VisionTokens:
    """The vision special tokens' ids in the artifact's tokenizer."""

    vision_start: int
    vision_end: int
    image_pad: int
    video_pad: int


class MediaExpansion:
    def __init__(self, tokens: VisionTokens, encode_text):
        """encode_text: text -> token ids (the time stamps of video blocks)."""
        self.tokens = tokens
        self.encode_text = encode_text

    def expand(self, prompt: PreparedPrompt, items: Sequence[PreparedItem]) -> PreparedPrompt:
        """The prompt with every placeholder expanded, in order; items are in prompt order."""
        ids = prompt.token_ids
        pads = [i for i, token in enumerate(ids) if token in (self.tokens.image_pad, self.tokens.video_pad)]
        if len(pads) != len(items):
            raise PromptError(
                f"the rendered prompt holds {len(pads)} media placeholders for {len(items)} media items "
                "(the chat template dropped or duplicated some)"
            )
        out: list[int] = []
        media: list[MediaInput] = []
        shifts: list[tuple[int, int]] = []  # (item's placeholder index, expanded minus original length after it)
        copied = 0
        for pad, item in zip(pads, items):
            expected = self.tokens.video_pad if item.modality == "video" else self.tokens.image_pad
            if ids[pad] != expected:
                raise PromptError(f"a {item.modality} item sits where the prompt has another modality's placeholder")
            if item.modality == "image":
                out += ids[copied:pad]
                starts = [len(out)]
                out += [self.tokens.image_pad] * self._tokens_per_group(item)
                copied = pad + 1
            else:
                if not (0 < pad < len(ids) - 1 and ids[pad - 1] == self.tokens.vision_start
                        and ids[pad + 1] == self.tokens.vision_end):
                    raise PromptError("a video placeholder is not inside <|vision_start|> ... <|vision_end|>")
                out += ids[copied : pad - 1]
                starts = self._video_blocks(item, out)
                copied = pad + 2
            shifts.append((pad, len(out) - copied))
            modality = "video" if item.modality == "video" else "image"
            media.append(MediaInput(modality, item.sha256, tuple(item.grid_thw), starts, patch_bytes(item.patches)))
        out += ids[copied:]
        hints = [CaptureHint(self._moved(h.frontier, shifts), h.path, h.implicit) for h in prompt.capture_hints]
        return dataclasses.replace(prompt, token_ids=out, capture_hints=hints, media=media)

    @staticmethod
    def _tokens_per_group(item: PreparedItem) -> int:
        _, height, width = item.grid_thw
        return height * width // (SPATIAL_MERGE * SPATIAL_MERGE)

    def _video_blocks(self, item: PreparedItem, out: list[int]) -> list[int]:
        """Append one time-stamped block per temporal patch to out; -> each block's first pad index."""
        time_patches = item.grid_thw[0]
        stamps = list(item.timestamps_s or [])
        if len(stamps) != time_patches:
            raise PromptError(f"a video has {time_patches} temporal patches but {len(stamps)} time stamps")
        starts = []
        for seconds in stamps:
            out += self.encode_text(f"<{seconds:.1f} seconds>")
            out.append(self.tokens.vision_start)
            starts.append(len(out))
            out += [self.tokens.video_pad] * self._tokens_per_group(item)
            out.append(self.tokens.vision_end)
        return starts

    @staticmethod
    def _moved(frontier: int, shifts: list[tuple[int, int]]) -> int:
        """A frontier (a token count) of the unexpanded prompt, in the expanded one."""
        moved = frontier
        for index, delta in shifts:
            if index < frontier:
                moved = frontier + delta
        return moved


def patch_bytes(patches: torch.Tensor) -> bytes:
    """bf16 patches as raw bytes (numpy has no bf16: the bits travel as int16)."""
    return patches.contiguous().view(torch.int16).numpy().tobytes()
