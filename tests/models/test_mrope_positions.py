"""MRoPE (t, h, w) positions of prompts with images and videos: equal to transformers'
Qwen3_5Model.get_rope_index (positions and rope delta), and any token range equal to the slice
of the whole prompt's positions (chunked prefill, prefix reuse, decode)."""

from __future__ import annotations

from enum import Enum

import pytest
import torch
import transformers as tf

from ninfer.models.mrope_positions import (
    IMAGE,
    VIDEO,
    MediaPlacement,
    build_mrope_layout,
    mrope_positions,
    text_positions,
)

IMAGE_PAD, VIDEO_PAD = 248_056, 248_057
VISION_START, VISION_END = 248_053, 248_054


@pytest.fixture(scope="module")
def reference() -> tf.Qwen3_5Model:
    text = dict(
        vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, layer_types=["full_attention"], linear_num_key_heads=1,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  num_position_embeddings=16, spatial_merge_size=2)
    return tf.Qwen3_5Model(tf.Qwen3_5Config(text_config=text, vision_config=vision)).eval()


class Prompt:
    """Token ids built left to right, recording each media item's placement as the processor lays it out."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.media: list[MediaPlacement] = []
        self._next_text = 10

    def text(self, count: int) -> Prompt:
        self.ids += [self._next_text + i for i in range(count)]
        self._next_text += count
        return self

    def image(self, h: int, w: int, t: int = 1) -> Prompt:
        self.ids.append(VISION_START)
        self.media.append(MediaPlacement(IMAGE, (t, h, w), len(self.ids)))
        self.ids += [IMAGE_PAD] * (t * h * w // 4)
        self.ids.append(VISION_END)
        return self

    def video(self, t: int, h: int, w: int) -> Prompt:
        """Each temporal step after its own timestamp text, in its own placeholder run."""
        for step in range(t):
            self.text(3)
            self.ids.append(VISION_START)
            if step == 0:
                self.media.append(MediaPlacement(VIDEO, (t, h, w), len(self.ids)))
            self.ids += [VIDEO_PAD] * (h * w // 4)
            self.ids.append(VISION_END)
        return self


def transformers_positions(model: tf.Qwen3_5Model, prompt: Prompt) -> tuple[torch.Tensor, int]:
    ids = torch.tensor([prompt.ids])
    token_types = torch.zeros_like(ids)
    token_types[ids == IMAGE_PAD] = 1
    token_types[ids == VIDEO_PAD] = 2
    images = [m.grid_thw for m in prompt.media if m.modality == IMAGE]
    videos = [m.grid_thw for m in prompt.media if m.modality == VIDEO]
    positions, delta = model.get_rope_index(
        ids,
        token_types,
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None,
    )
    return positions[:, 0], int(delta)


PROMPTS = {
    "text-only": lambda: Prompt().text(9),
    "image-mid-prompt": lambda: Prompt().text(4).image(4, 6).text(3),
    "tall-image": lambda: Prompt().text(2).image(10, 4).text(2),
    "image-first-and-last": lambda: Prompt().image(6, 4).text(2).image(2, 2),
    "two-images": lambda: Prompt().text(3).image(4, 6).text(2).image(8, 8).text(5),
    "adjacent-images": lambda: Prompt().text(1).image(4, 4).image(2, 6).text(1),
    "video": lambda: Prompt().text(4).video(3, 4, 6).text(4),
    "image-and-video": lambda: Prompt().text(2).image(6, 6).text(1).video(2, 2, 4).text(6),
    "two-frame-image": lambda: Prompt().text(2).image(2, 2, t=2).text(2),
    # t reaches past rows and columns: the delta (max position + 1 - length) outruns the text
    "four-frame-image-last": lambda: Prompt().text(2).image(2, 2, t=4),
}


@pytest.mark.parametrize("build", PROMPTS.values(), ids=PROMPTS.keys())
def test_positions_match_transformers(reference, build):
    prompt = build()
    expected, expected_delta = transformers_positions(reference, prompt)
    positions, delta = mrope_positions(prompt.ids, prompt.media)
    assert positions.dtype == torch.long and positions.shape == (3, len(prompt.ids))
    assert torch.equal(positions, expected)
    assert delta == expected_delta


def test_text_only_is_one_dimensional():
    positions, delta = mrope_positions(list(range(7)), [])
    assert delta == 0
    assert torch.equal(positions, torch.arange(7).expand(3, -1))


@pytest.mark.parametrize("build", PROMPTS.values(), ids=PROMPTS.keys())
def test_any_token_range_is_the_slice_of_the_whole(build):
    prompt = build()
    layout = build_mrope_layout(prompt.ids, prompt.media)
    whole = layout.positions()
    length = len(prompt.ids)
    for start in range(length + 1):
        for end in (start, min(start + 1, length), min(start + 5, length), length):
            assert torch.equal(layout.positions(start, end), whole[:, start:end]), (start, end)
    for chunk in (1, 3, 7):  # a chunked prefill's pieces put back together
        pieces = [layout.positions(s, min(s + chunk, length)) for s in range(0, length, chunk)]
        assert torch.equal(torch.cat(pieces, dim=1), whole)


@pytest.mark.parametrize("build", PROMPTS.values(), ids=PROMPTS.keys())
def test_tokens_after_the_prompt_continue_at_index_plus_delta(reference, build):
    """Decode: positions past the prompt are cache_len + rope_delta; transformers, run over the
    prompt plus generated text, puts those tokens at the same positions."""
    prompt = build()
    length = len(prompt.ids)
    layout = build_mrope_layout(prompt.ids, prompt.media)
    continued = layout.positions(length - 2, length + 4)
    assert torch.equal(continued[:, 2:], text_positions(length, length + 4, layout.rope_delta))
    if not any(m.modality == IMAGE and m.grid_thw[0] > 1 for m in prompt.media):
        # (an image of t > 1 steps may end past its rows and columns: decode then follows the delta)
        extended, _ = transformers_positions(reference, prompt.text(4))
        assert torch.equal(continued, extended[:, length - 2 :])


def test_placement_must_sit_on_its_placeholders():
    prompt = Prompt().text(2).image(4, 4).text(2)
    moved = [MediaPlacement(IMAGE, (1, 4, 4), prompt.media[0].start - 1)]
    with pytest.raises(ValueError, match="is not a image placeholder"):
        mrope_positions(prompt.ids, moved)
    wrong_grid = [MediaPlacement(IMAGE, (1, 4, 6), prompt.media[0].start)]
    with pytest.raises(ValueError, match="needs 6 placeholder tokens, the prompt has 4 left"):
        mrope_positions(prompt.ids, wrong_grid)
    as_video = [MediaPlacement(VIDEO, (1, 4, 4), prompt.media[0].start)]
    with pytest.raises(ValueError, match="is not a video placeholder"):
        mrope_positions(prompt.ids, as_video)


def test_every_placeholder_needs_a_placement():
    prompt = Prompt().text(2).image(4, 4).text(1).image(2, 2)
    with pytest.raises(ValueError, match="holds 5 image placeholder tokens; the media placements cover 4"):
        mrope_positions(prompt.ids, prompt.media[:1])


def test_video_steps_must_each_be_one_run():
    prompt = Prompt().video(2, 4, 4)
    broken = list(prompt.ids)
    broken[prompt.media[0].start + 1] = 5  # splits the first step's run
    with pytest.raises(ValueError, match=r"\(step 0 of 2\): its 4 placeholder tokens are not one run"):
        mrope_positions(broken, prompt.media)


class Modality(str, Enum):  # the shape of ninfer.media.Modality, what the lead will pass
    IMAGE = "image"
    VIDEO = "video"


def test_placements_may_name_modalities_with_a_str_enum():
    prompt = Prompt().text(2).image(4, 4).video(2, 2, 4)
    as_enum = [MediaPlacement(Modality(m.modality), m.grid_thw, m.start) for m in prompt.media]
    assert torch.equal(mrope_positions(prompt.ids, as_enum)[0], mrope_positions(prompt.ids, prompt.media)[0])
