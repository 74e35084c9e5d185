"""GrammarVocabulary: the tokenizer as the grammar library sees it (each id's bytes), built once.

Both processes build the same one from the same tokenizer: the API process compiles grammars
against it, the engine deserializes them against it. Indexing a 248K vocabulary takes about a
second, so it is built on first use, never at start-up.

Special added tokens (`<|im_end|>`, `<|im_start|>`, padding ...) are given no text: a grammar can
never spell them, so a JSON string can never end a turn; end-of-turn ids are allowed only where
the grammar is complete, as its stop tokens. Non-special added tokens (`<tool_call>`, `</think>`)
keep their text, so a tool-call grammar matches the ids the model was trained to write. Tokens
that spell a C0 control character other than tab, newline and carriage return get no text either:
the library's length-bounded JSON strings would admit them raw, which no JSON parser accepts.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ninfer.frontend.grammar_library import grammar_library
from ninfer.frontend.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

_ALLOWED_CONTROLS = frozenset("\t\n\r")
# Byte-level vocabularies write byte b < 0x21 as the character U+0100 + b (the GPT-2 byte alphabet).
_BYTE_LEVEL_CONTROLS = frozenset(chr(0x100 + b) for b in range(0x20) if chr(b) not in _ALLOWED_CONTROLS)
_RAW_CONTROLS = frozenset(chr(b) for b in range(0x20) if chr(b) not in _ALLOWED_CONTROLS)
_FALLBACK_CONTROLS = frozenset(f"<0x{b:02X}>" for b in range(0x20) if chr(b) not in _ALLOWED_CONTROLS)


def _spells_control(text: str, vocab_type: xgrammar.VocabType) -> bool:
    if vocab_type is grammar_library().VocabType.BYTE_LEVEL:
        return not _BYTE_LEVEL_CONTROLS.isdisjoint(text)
    if vocab_type is grammar_library().VocabType.BYTE_FALLBACK and text in _FALLBACK_CONTROLS:
        return True
    return not _RAW_CONTROLS.isdisjoint(text)


def _vocab_type(decoder: dict[str, Any]) -> tuple[xgrammar.VocabType, bool]:
    """(how token strings encode bytes, whether decoding drops the leading space sentencepiece
    vocabularies prepend) from the tokenizer's decoder."""
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {part.get("type") for part in parts if isinstance(part, dict)}
    if "ByteLevel" in kinds:
        return grammar_library().VocabType.BYTE_LEVEL, False
    strips_space = any(
        (part.get("type") == "Metaspace" and part.get("prepend_scheme", "always") != "never")
        or (part.get("type") == "Strip" and part.get("start", 0) > 0)
        for part in parts
    )
    if "ByteFallback" in kinds:
        return grammar_library().VocabType.BYTE_FALLBACK, strips_space
    return grammar_library().VocabType.RAW, strips_space


class GrammarVocabulary:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        """vocab_size: the model's logits width (past the tokenizer's ids: padding rows)."""
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self._info: xgrammar.TokenizerInfo | None = None
        self._token_bytes: list[bytes] | None = None
        self._lock = threading.Lock()
        self._bytes_lock = threading.Lock()

    @property
    def info(self) -> xgrammar.TokenizerInfo:
        with self._lock:
            if self._info is None:
                self._info = self._build()
            return self._info

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Each id's bytes as the model writes them (special tokens: their text)."""
        table = self._token_bytes
        if table is None:
            # Requests with log probabilities arriving together wait for one build (~1 s of CPU on 248K ids).
            with self._bytes_lock:
                if self._token_bytes is None:
                    decoded = list(self.info.decoded_vocab)
                    for token_id, token in self.tokenizer.backend.get_added_tokens_decoder().items():
                        if token_id < len(decoded):
                            decoded[token_id] = token.content.encode()
                    self._token_bytes = decoded
                table = self._token_bytes
        return [table[i] if 0 <= i < len(table) else b"" for i in token_ids]

    def _build(self) -> xgrammar.TokenizerInfo:
        backend = self.tokenizer.backend
        encoded = [""] * self.vocab_size
        for text, token_id in backend.get_vocab(with_added_tokens=True).items():
            if token_id < self.vocab_size:
                encoded[token_id] = text
        added = backend.get_added_tokens_decoder()
        decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
        vocab_type, strips_space = _vocab_type(decoder)
        for token_id, text in enumerate(encoded):
            if text and token_id not in added and _spells_control(text, vocab_type):
                encoded[token_id] = ""
        for token_id, token in added.items():
            if token.special and token_id < self.vocab_size:
                encoded[token_id] = ""
        return grammar_library().TokenizerInfo(
            encoded, vocab_type=vocab_type, vocab_size=self.vocab_size, add_prefix_space=strips_space
        )
