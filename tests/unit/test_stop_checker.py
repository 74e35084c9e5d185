"""StopChecker on real byte-level BPE tokenizers: exact trimming, holdback, stop tokens.

Most tests build a tiny byte-level tokenizer whose vocabulary holds all 256 bytes plus the
pieces a test needs, so a test chooses the token boundaries (inside a word, inside a UTF-8
character) and feeds ids directly."""

from __future__ import annotations

import random
from functools import lru_cache

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers.models import BPE

from ninfer.engine.stop_checker import StopChecker, StopStep
from ninfer.frontend.tokenizer import Tokenizer

SPECIAL = "<|im_end|>"
MARKER = "<|mark|>"  # a second special token, decoded unless skipped


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as the ByteLevel decoder expects."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _as_token(piece: bytes) -> str:
    table = _byte_to_unicode()
    return "".join(table[b] for b in piece)


class TinyVocab:
    """All single bytes plus the given multi-byte pieces; `ids(...)` spells a token sequence."""

    def __init__(self, pieces: list[bytes | str] = ()):
        raw = [bytes([b]) for b in range(256)]
        for piece in pieces:
            piece = piece.encode() if isinstance(piece, str) else piece
            if piece not in raw:
                raw.append(piece)
        self.piece_ids = {piece: i for i, piece in enumerate(raw)}
        backend = tokenizers.Tokenizer(BPE({_as_token(p): i for p, i in self.piece_ids.items()}, []))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(SPECIAL, special=True), AddedToken(MARKER, special=True)])
        self.tokenizer = Tokenizer(backend, eos_token=SPECIAL)
        self.eos = self.tokenizer.token_to_id(SPECIAL)
        self.marker = self.tokenizer.token_to_id(MARKER)

    def ids(self, *pieces: bytes | str | int) -> list[int]:
        """str/bytes pieces are vocabulary entries; ints are token ids (special tokens)."""
        return [p if isinstance(p, int) else self.piece_ids[p.encode() if isinstance(p, str) else p] for p in pieces]

    def checker(self, stops: list[str] = (), stop_ids: list[int] = (), skip_special: bool = False) -> StopChecker:
        return StopChecker(self.tokenizer, stop_ids, stops, skip_special_tokens=skip_special)


def run(checker: StopChecker, ids: list[int]) -> tuple[list[StopStep], str]:
    """Feed until a stop; return the steps and all emitted text (flushed at a non-stop end)."""
    steps = []
    for token_id in ids:
        steps.append(checker.append(token_id))
        if steps[-1].stopped:
            return steps, "".join(s.text for s in steps)
    return steps, "".join(s.text for s in steps) + checker.flush()


def first_stop(text: str, stops: list[str]) -> int | None:
    """Brute force: the start of the occurrence a character-by-character reader sees first."""
    for end in range(1, len(text) + 1):
        hits = [end - len(s) for s in stops if text[:end].endswith(s)]
        if hits:
            return min(hits)
    return None


def test_stop_string_inside_one_token_cuts_the_token_text() -> None:
    vocab = TinyVocab(["Hi ", "abcSTOPdef"])
    steps, text = run(vocab.checker(["STOP"]), vocab.ids("Hi ", "abcSTOPdef", "Hi "))
    assert [s.text for s in steps] == ["Hi ", "abc"]
    assert steps[-1] == StopStep("abc", stopped=True, stop_reason="STOP")
    assert text == "Hi abc"


def test_stop_string_spanning_tokens_holds_back_its_beginning() -> None:
    vocab = TinyVocab(["Hello", " ST", "OP", " more"])
    steps, text = run(vocab.checker(["STOP"]), vocab.ids("Hello", " ST", "OP", " more"))
    assert [s.text for s in steps] == ["Hello", " ", ""]
    assert steps[-1].stopped and steps[-1].stop_reason == "STOP"
    assert text == "Hello "


def test_stop_string_at_the_very_start_emits_nothing() -> None:
    vocab = TinyVocab(["STOP", "x"])
    steps, text = run(vocab.checker(["STOP"]), vocab.ids("STOP", "x"))
    assert len(steps) == 1 and steps[0] == StopStep("", stopped=True, stop_reason="STOP")
    assert text == ""


def test_holdback_is_released_when_the_prefix_stops_matching() -> None:
    vocab = TinyVocab(["a ST", "AR", "S", "TO", "P!"])
    checker = vocab.checker(["STOP"])
    assert checker.append(vocab.ids("a ST")[0]).text == "a "
    assert checker.append(vocab.ids("AR")[0]).text == "STAR"
    assert checker.append(vocab.ids("S")[0]).text == ""
    assert checker.append(vocab.ids("TO")[0]).text == ""
    step = checker.append(vocab.ids("P!")[0])
    assert step == StopStep("", stopped=True, stop_reason="STOP")


def test_a_non_stop_end_flushes_the_held_text() -> None:
    vocab = TinyVocab(["tail S", "TO"])
    checker = vocab.checker(["STOP"])
    assert checker.append(vocab.ids("tail S")[0]).text == "tail "
    assert checker.append(vocab.ids("TO")[0]).text == ""
    assert checker.flush() == "STO"
    assert not checker.stopped


@pytest.mark.parametrize(
    ("stops", "pieces", "emitted", "reason"),
    [
        (["abcd", "bc"], ["ab", "cd"], "a", "bc"),  # the shorter one completes first
        (["cd", "bcd"], ["abcde"], "a", "bcd"),  # same end: the earlier start wins
        (["aab"], ["a", "a", "a", "b"], "a", "aab"),  # self-overlap: "aaab" holds "aa"
        (["xyz", "yq"], ["x", "y", "q"], "x", "yq"),  # a held candidate fails, a later one wins
        (["ab", "b"], ["ab"], "", "ab"),
    ],
)
def test_overlapping_candidates(stops: list[str], pieces: list[str], emitted: str, reason: str) -> None:
    vocab = TinyVocab(pieces)
    steps, text = run(vocab.checker(stops), vocab.ids(*pieces))
    assert text == emitted
    assert steps[-1].stopped and steps[-1].stop_reason == reason
    assert len(steps) == len(pieces)  # the stop comes with the token that completes it


def test_multi_byte_characters_are_never_split() -> None:
    euro = "€".encode()  # 3 bytes
    vocab = TinyVocab([euro[:2], euro[2:] + b"x", b"caf\xc3", b"\xa9!"])
    checker = vocab.checker(["é!"])
    assert checker.append(vocab.ids(euro[:2])[0]).text == ""
    assert checker.append(vocab.ids(euro[2:] + b"x")[0]).text == "€x"
    assert checker.append(vocab.ids(b"caf\xc3")[0]).text == ""  # incomplete é
    step = checker.append(vocab.ids(b"\xa9!")[0])  # completes é, then "!" completes the stop
    assert step == StopStep("caf", stopped=True, stop_reason="é!")


def test_a_token_ending_mid_character_still_stops_where_the_stop_string_completes() -> None:
    euro = "€".encode()
    vocab = TinyVocab([b"xEND" + euro[:1], euro[1:] + b"y"])
    steps, text = run(vocab.checker(["END"]), vocab.ids(b"xEND" + euro[:1], euro[1:] + b"y"))
    assert len(steps) == 1 and steps[0] == StopStep("x", stopped=True, stop_reason="END")


def test_stop_string_made_of_one_multi_byte_character() -> None:
    euro = "€".encode()
    vocab = TinyVocab(["a", euro[:1], euro[1:]])
    steps, text = run(vocab.checker(["€"]), vocab.ids("a", euro[:1], euro[1:], "a"))
    assert text == "a" and steps[-1].stop_reason == "€" and len(steps) == 3


def test_stop_token_is_withheld_and_releases_held_text() -> None:
    vocab = TinyVocab(["Hello", " ST"])
    checker = vocab.checker(["STOP"], stop_ids=[vocab.eos])
    assert checker.append(vocab.ids("Hello")[0]).text == "Hello"
    assert checker.append(vocab.ids(" ST")[0]).text == " "
    step = checker.append(vocab.eos)
    assert step == StopStep("ST", stopped=True, stop_reason=vocab.eos)
    assert checker.stopped and checker.stop_reason == vocab.eos
    with pytest.raises(RuntimeError):
        checker.append(vocab.ids("Hello")[0])
    assert checker.flush() == ""


def test_stop_token_after_an_incomplete_character_emits_what_decode_gives() -> None:
    euro = "€".encode()
    vocab = TinyVocab(["ok", euro[:2]])
    ids = vocab.ids("ok", euro[:2])
    steps, text = run(vocab.checker(stop_ids=[vocab.eos]), [*ids, vocab.eos])
    assert steps[-1].stop_reason == vocab.eos
    assert text == vocab.tokenizer.decode(ids)  # "ok\ufffd": the dangling bytes, as decode shows them


def test_special_tokens_match_as_emitted() -> None:
    vocab = TinyVocab(["a", "b"])
    ids = [*vocab.ids("a"), vocab.marker, *vocab.ids("b")]
    # Kept special text is part of the stream: it can be a stop string and it separates "a" from "b".
    steps, text = run(vocab.checker(["ab", MARKER]), ids)
    assert text == "a" and steps[-1].stop_reason == MARKER and len(steps) == 2
    # Skipped special tokens vanish from the text, so "ab" now matches across one.
    steps, text = run(vocab.checker(["ab", MARKER], skip_special=True), ids)
    assert text == "" and steps[-1].stop_reason == "ab" and len(steps) == 3


def test_empty_stop_strings_are_rejected() -> None:
    with pytest.raises(ValueError):
        TinyVocab().checker(["ok", ""])


def test_emitted_text_equals_the_full_text_cut_before_the_first_stop_for_random_splits() -> None:
    rng = random.Random(1234)
    alphabet = ["a", "b", "S", "T", "O", "P", " ", "é", "€", "😀"]
    stop_sets = [["STOP"], ["ab", "ba"], ["é€", "P😀"], ["aab", "STO", "b a", "€€"], ["zzz"]]
    for trial in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = rng.choice(stop_sets)
        data = text.encode()
        cuts = sorted(rng.sample(range(1, len(data)), k=min(len(data) - 1, rng.randint(0, 12)))) if data else []
        pieces = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)])]
        vocab = TinyVocab(pieces)
        checker = vocab.checker(stops)
        released = vocab.tokenizer.incremental()  # what the checker's detokenizer lets through
        released_text = ""
        emitted = ""
        decoded = b""
        start = first_stop(text, stops)
        for n, piece in enumerate(pieces, 1):
            step = checker.append(vocab.ids(piece)[0])
            emitted += step.text
            decoded += piece
            assert text.startswith(emitted)
            if step.stopped:
                # The token that completes the first occurrence stops, and nothing earlier did.
                assert start is not None and first_stop(decoded.decode(errors="ignore"), stops) == start
                assert first_stop(data[: len(decoded) - len(piece)].decode(errors="ignore"), stops) is None
                break
            # All detokenized text has been released except a possible stop beginning.
            released_text += released.push(vocab.ids(piece))
            held = released_text[len(emitted) :]
            assert released_text.startswith(emitted)
            assert held == "" or any(s.startswith(held) and s != held for s in stops), (trial, n, held)
        else:
            emitted += checker.flush()
            assert start is None, (trial, text, stops)
        assert emitted == (text if start is None else text[:start]), (trial, text, stops, pieces)


def test_with_the_real_qwen_tokenizer() -> None:
    try:
        from ninfer.assets.qwen_tokenizer import build_qwen3_5_tokenizer
    except ImportError:
        pytest.skip("Qwen tokenizer builder not available")
    tokenizer = Tokenizer(build_qwen3_5_tokenizer(), eos_token="<|im_end|>")
    text = "Sure — the answer is 42.\nEND of answer. 日本語 more text"
    ids = tokenizer.encode(text)
    checker = StopChecker(tokenizer, [tokenizer.eos_token_id], ["\nEND", "語 m"])
    steps, emitted = run(checker, ids)
    assert emitted == "Sure — the answer is 42."
    assert steps[-1].stop_reason == "\nEND"
    checker = StopChecker(tokenizer, [tokenizer.eos_token_id], ["語 m"])
    steps, emitted = run(checker, [*ids, tokenizer.eos_token_id])
    assert emitted == text[: text.index("語 m")] and steps[-1].stop_reason == "語 m"
    checker = StopChecker(tokenizer, [tokenizer.eos_token_id], ["never"])
    steps, emitted = run(checker, [*ids, tokenizer.eos_token_id, *ids])
    assert emitted == text and steps[-1].stop_reason == tokenizer.eos_token_id
