"""PromptEncoder: reusing a recent prompt's ids up to a message boundary gives exactly the ids
of encoding the whole prompt afresh, whatever the new text does after the shared part."""

from __future__ import annotations

import random

import pytest

from ninfer.assets.qwen_tokenizer import build_qwen3_5_tokenizer, qwen3_5_tokenizer_config
from ninfer.frontend.prompt_encoder import PromptEncoder
from ninfer.frontend.tokenizer import LONG_TEXT_CHARS, Tokenizer

PIECES = ["hello", " world", "  spaced", "\n", "naïve café", "日本語", "123 456", "<|im_end", "|>", "emoji 🎉", " "]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    config = qwen3_5_tokenizer_config(None)
    return Tokenizer(build_qwen3_5_tokenizer(), eos_token=config["eos_token"], config=config)


def message(rng: random.Random, role: str) -> str:
    body = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))
    return f"<|im_start|>{role}\n{body}<|im_end|>\n"


def test_extensions_and_edits_encode_as_a_fresh_encode(tokenizer):
    rng = random.Random(7)
    encoder = PromptEncoder(tokenizer)
    conversation = message(rng, "system")
    for turn in range(40):
        conversation += message(rng, "user")
        prompt = conversation + "<|im_start|>assistant\n"
        kind = rng.choice(["extend", "edit", "cut-inside-token", "cut-at-boundary"])
        if kind == "edit" and turn:
            # Change the last message's text: the shared part ends inside it.
            prompt = conversation[:-8] + "edited" + conversation[-8:] + "<|im_start|>assistant\n"
        elif kind == "cut-inside-token":
            prompt = conversation + "<|im_sta"  # a special token's text cut short: plain text now
        elif kind == "cut-at-boundary":
            prompt = conversation
        encoded = encoder.encode(prompt)
        ids, points = tokenizer.encode_with_split_points(prompt)
        assert encoded.token_ids == ids, (turn, kind)
        assert encoded.split_points == points, (turn, kind)
        conversation += message(rng, "assistant")
    assert encoder.num_reused_tokens > 0


def test_a_prompt_sharing_nothing_is_encoded_whole(tokenizer):
    encoder = PromptEncoder(tokenizer)
    first = encoder.encode("<|im_start|>user\nabc<|im_end|>\n")
    assert encoder.num_reused_tokens == 0
    other = encoder.encode("plain text without any message")
    assert other.token_ids == tokenizer.encode("plain text without any message")
    assert encoder.num_reused_tokens == 0 and first.token_ids == tokenizer.encode(first.text)


def fresh_split_points(tokenizer: Tokenizer, text: str) -> tuple[list[int], dict[int, int]]:
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    ids, offsets = encoding.ids, encoding.offsets
    return ids, {offsets[i][0]: i for i, t in enumerate(ids) if t in tokenizer.clean_split_ids}


@pytest.mark.parametrize("read_off_the_text", [True, False])
def test_a_long_prompt_has_the_ids_and_split_points_of_a_plain_encode(tokenizer, monkeypatch, read_off_the_text):
    """Long prompts are encoded without offsets and their split points found in the text; where
    that cannot be trusted, from the encoding's offsets. Both give what a plain encode gives."""
    if not read_off_the_text:
        monkeypatch.setattr(tokenizer, "_findable_split_tokens", {})
    rng = random.Random(11)
    text = "".join(message(rng, rng.choice(["user", "assistant"])) for _ in range(3000))
    text += "<|im_sta" + "<think>\nplain <|im_end text\n</think>\n" + "<|im_start|>assistant\n"
    assert len(text) >= LONG_TEXT_CHARS
    ids, points = tokenizer.encode_with_split_points(text)
    assert (ids, points) == fresh_split_points(tokenizer, text)
    assert len(points) > 6000
    assert (tokenizer._long_split_points(text, ids) is not None) == read_off_the_text
    assert tokenizer.encode(text) == ids
