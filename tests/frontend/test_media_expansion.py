"""MediaExpansion: placeholders become each item's tokens; capture frontiers move with them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ninfer.contract.media import PATCH_VALUES
from ninfer.contract.request import CaptureHint
from ninfer.contract.reuse_path import ReusePath
from ninfer.frontend.media_expansion import MediaExpansion, VisionTokens
from ninfer.frontend.prompt_builder import PreparedPrompt, PromptError

TOKENS = VisionTokens(vision_start=900, vision_end=901, image_pad=902, video_pad=903)
STAMP_IDS = {"<0.5 seconds>": [70, 71], "<1.5 seconds>": [72, 71]}


@dataclass
class Item:
    modality: str
    sha256: str
    grid_thw: tuple[int, int, int]
    timestamps_s: tuple[float, ...] | None = None

    @property
    def patches(self) -> torch.Tensor:
        t, h, w = self.grid_thw
        return torch.arange(t * h * w * PATCH_VALUES, dtype=torch.float32).view(-1, PATCH_VALUES).bfloat16()


def prompt(ids, frontiers=()):
    hints = [CaptureHint(f, ReusePath.PRIVATE_TURN_CLOSURE) for f in frontiers]
    return PreparedPrompt(ids, thinking=False, capture_hints=hints, enable_thinking=None, preserve_thinking=None)


def expansion():
    return MediaExpansion(TOKENS, lambda text: STAMP_IDS[text])


def test_an_image_pad_becomes_its_merged_tokens_and_later_frontiers_move():
    ids = [1, 2, 900, 902, 901, 3, 4]
    out = expansion().expand(prompt(ids, frontiers=[2, 6]), [Item("image", "ab" * 32, (1, 4, 6))])
    assert out.token_ids == [1, 2, 900] + [902] * 6 + [901, 3, 4]
    assert [h.frontier for h in out.capture_hints] == [2, 11]  # 6 + 5 added tokens
    (media,) = out.media
    assert media.token_starts == [3] and media.num_tokens == 6 and media.grid_thw == (1, 4, 6)
    assert len(media.patches) == 24 * PATCH_VALUES * 2
    assert torch.equal(
        torch.frombuffer(bytearray(media.patches), dtype=torch.bfloat16).view(24, PATCH_VALUES),
        Item("image", "", (1, 4, 6)).patches,
    )


def test_a_video_triple_becomes_time_stamped_blocks_per_temporal_patch():
    ids = [1, 900, 903, 901, 5]
    video = Item("video", "cd" * 32, (2, 2, 4), timestamps_s=(0.5, 1.5))
    out = expansion().expand(prompt(ids, frontiers=[1, 5]), [video])
    block = lambda stamp: STAMP_IDS[stamp] + [900, 903, 903, 901]  # noqa: E731
    assert out.token_ids == [1] + block("<0.5 seconds>") + block("<1.5 seconds>") + [5]
    assert out.media[0].token_starts == [4, 10]
    assert [h.frontier for h in out.capture_hints] == [1, 5 + 12 - 3]


def test_two_items_keep_prompt_order_and_shift_cumulatively():
    ids = [900, 902, 901, 7, 900, 902, 901, 8]
    items = [Item("image", "01" * 32, (1, 2, 2)), Item("image", "02" * 32, (1, 4, 4))]
    out = expansion().expand(prompt(ids, frontiers=[3, 4, 8]), items)
    assert out.token_ids == [900, 902, 901, 7, 900] + [902] * 4 + [901, 8]
    assert [m.token_starts for m in out.media] == [[1], [5]]
    assert [h.frontier for h in out.capture_hints] == [3, 4, 11]


@pytest.mark.parametrize(
    ("ids", "items", "message"),
    [
        ([900, 902, 901], [], "1 media placeholders for 0 media items"),
        ([900, 902, 901], [Item("video", "aa", (1, 2, 2), (0.5,))], "another modality"),
        ([903, 901], [Item("video", "aa", (1, 2, 2), (0.5,))], "not inside"),
        ([900, 903, 901], [Item("video", "aa", (2, 2, 2), (0.5,))], "2 temporal patches but 1 time stamps"),
    ],
)
def test_mismatches_are_prompt_errors(ids, items, message):
    with pytest.raises(PromptError, match=message):
        expansion().expand(prompt(ids), items)
