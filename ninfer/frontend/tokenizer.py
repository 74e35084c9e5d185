"""Tokenizer over the `tokenizers` library, with UTF-8-safe incremental detokenization."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import tokenizers

from ninfer.frontend.tokenizer_clock import encode_timed

LONG_TEXT_CHARS = 1 << 16  # from here on, encode without holding the GIL
# Parsed tokenizer.json files kept by content: parsing Qwen's 248K-token vocabulary takes seconds,
# and a process that opens one model several times (the API side and an in-process engine, a
# test session's artifacts) parses each file once. Backends are only read after parsing, so
# they are shared.
_PARSED_KEPT = 4
_parsed: OrderedDict[bytes, tokenizers.Tokenizer] = OrderedDict()
_parsed_lock = threading.Lock()


def _parsed_backend(tokenizer_json: Path) -> tokenizers.Tokenizer:
    text = Path(tokenizer_json).read_bytes()
    key = hashlib.blake2b(text, digest_size=16).digest()
    with _parsed_lock:
        if key in _parsed:
            _parsed.move_to_end(key)
            return _parsed[key]
    backend = tokenizers.Tokenizer.from_str(text.decode("utf-8"))
    with _parsed_lock:
        _parsed[key] = backend
        while len(_parsed) > _PARSED_KEPT:
            _parsed.popitem(last=False)
    return backend


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _overlaps_itself(content: str) -> bool:
    """Whether two occurrences of `content` can overlap (a proper prefix is also a suffix)."""
    return any(content[:n] == content[-n:] for n in range(1, len(content)))


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        config: dict[str, Any] | None = None,
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.add_bos_token = add_bos_token
        self.config = config or {}
        self.bos_token_id = self.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = self.token_to_id(eos_token) if eos_token else None
        self.pad_token_id = self.token_to_id(pad_token) if pad_token else None
        added = backend.get_added_tokens_decoder()
        self.special_token_ids = frozenset(i for i, t in added.items() if t.special)
        # Special tokens that take no whitespace before them: the text before one encodes to
        # exactly the ids before it, since added tokens are split out before the rest is encoded.
        self.clean_split_ids = frozenset(i for i, t in added.items() if t.special and not t.lstrip and not t.normalized)
        # Those whose text cannot overlap itself: str.find then meets every occurrence in a long
        # prompt, so their offsets are found without the encoding's offsets (_long_split_points).
        self._findable_split_tokens = {
            i: added[i].content for i in self.clean_split_ids if not _overlaps_itself(added[i].content)
        }

    @classmethod
    def from_files(cls, tokenizer_json: Path, tokenizer_config: dict[str, Any] | None = None) -> Tokenizer:
        backend = _parsed_backend(tokenizer_json)
        cfg = tokenizer_config or {}
        return cls(
            backend,
            bos_token=_token_content(cfg.get("bos_token")),
            eos_token=_token_content(cfg.get("eos_token")),
            pad_token=_token_content(cfg.get("pad_token")),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            config=cfg,
        )

    @classmethod
    def from_json_string(cls, tokenizer_json: str, tokenizer_config: dict[str, Any] | None = None) -> Tokenizer:
        backend = tokenizers.Tokenizer.from_str(tokenizer_json)
        cfg = tokenizer_config or {}
        return cls(
            backend,
            bos_token=_token_content(cfg.get("bos_token")),
            eos_token=_token_content(cfg.get("eos_token")),
            pad_token=_token_content(cfg.get("pad_token")),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            config=cfg,
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _encode(self, text: str, offsets: bool = True):
        # The batch call releases the GIL while the Rust side works; the single call may hold it
        # for the whole encode (seconds for a multi-MB prompt), stalling the API's event loop.
        # Reading and freeing an encoding hold the GIL too, and with offsets tracked that takes
        # hundreds of milliseconds at a million tokens: long texts are encoded without them.
        with encode_timed():
            if len(text) < LONG_TEXT_CHARS:
                return self.backend.encode(text, add_special_tokens=False)
            if offsets:
                return self.backend.encode_batch([text], add_special_tokens=False)[0]
            return self.backend.encode_batch_fast([text], add_special_tokens=False)[0]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Chat prompts are rendered by the template, which already holds any BOS: no specials by default."""
        ids = self._encode(text, offsets=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def encode_with_split_points(self, text: str) -> tuple[list[int], dict[int, int]]:
        """encode(text), and for each clean-splitting special token in it, char offset -> token
        index: text[:offset] encodes to exactly ids[:index], with no second encode."""
        if len(text) >= LONG_TEXT_CHARS:
            ids = self._encode(text, offsets=False).ids
            points = self._long_split_points(text, ids)
            if points is not None:
                return ids, points
            encoding = self._encode(text)
            ids = encoding.ids
            # Only the split tokens' offsets: converting all of them would hold the GIL.
            clean = self.clean_split_ids
            return ids, {encoding.token_to_chars(i)[0]: i for i, token in enumerate(ids) if token in clean}
        encoding = self._encode(text)
        ids = encoding.ids
        clean = self.clean_split_ids
        offsets = encoding.offsets
        return ids, {offsets[i][0]: i for i, token in enumerate(ids) if token in clean}

    def _long_split_points(self, text: str, ids: list[int]) -> dict[int, int] | None:
        """The split points read off the text: each clean-splitting token in ids is one literal
        occurrence of its text, so when a token's text occurs exactly as often as the token, its
        k-th occurrence is its k-th token. None when that does not hold (the caller then reads
        the encoding's offsets)."""
        clean = self.clean_split_ids
        indices = [i for i, token in enumerate(ids) if token in clean]
        by_token: dict[int, list[int]] = {}
        for i in indices:
            by_token.setdefault(ids[i], []).append(i)
        points: dict[int, int] = {}
        for token, token_indices in by_token.items():
            content = self._findable_split_tokens.get(token)
            if content is None:
                return None
            found, at = [], text.find(content)
            while at >= 0 and len(found) <= len(token_indices):
                found.append(at)
                at = text.find(content, at + len(content))
            if len(found) != len(token_indices):
                return None
            points.update(zip(found, token_indices, strict=True))
        # Occurrences of different tokens interleave in the text as their tokens do in ids.
        if [points[offset] for offset in sorted(points)] != indices:
            return None
        return points

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)

    def to_json(self) -> str:
        return self.backend.to_str()

    def dump_config(self) -> str:
        return json.dumps(self.config)


class IncrementalDetokenizer:
    """Turns a growing token stream into text deltas without splitting a UTF-8 character.

    Byte-level BPE tokens may end mid-character, and some decoders change earlier text
    once more tokens arrive (e.g. leading-space cleanup), so each step decodes a small
    window ending at the new tokens and emits text only once it no longer ends in an
    incomplete character (U+FFFD). Concatenated deltas equal decode(all ids).
    """

    # How many already-emitted tokens the decode window keeps as left context.
    _CONTEXT_TOKENS = 6

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # tokens before this are already emitted as text

    def push(self, new_ids: list[int]) -> str:
        """Add committed token ids; return the newly complete text (possibly empty)."""
        self.token_ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        full_text = decode(self.token_ids[self._prefix_offset :], self.skip_special_tokens)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self._read_offset = len(self.token_ids)
        self._prefix_offset = max(0, self._read_offset - self._CONTEXT_TOKENS)
        return delta

    def flush(self) -> str:
        """Text still held back at the end of the stream (an incomplete character decodes as U+FFFD)."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        full_text = decode(self.token_ids[self._prefix_offset :], self.skip_special_tokens)
        self._read_offset = len(self.token_ids)
        self._prefix_offset = max(0, self._read_offset - self._CONTEXT_TOKENS)
        return full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else ""
