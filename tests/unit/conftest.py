"""Fixtures for CPU unit tests of engine logic."""

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from ninfer.frontend.tokenizer import Tokenizer


def _byte_symbols() -> list[str]:
    """The byte-level BPE alphabet: printable bytes map to themselves, the rest above U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def make_byte_tokenizer() -> Tokenizer:
    """Token id == byte value (no merges), so multi-byte characters span tokens; id 256 is <eos>."""
    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab["<eos>"] = 256
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return Tokenizer(backend, eos_token="<eos>")


@pytest.fixture(scope="session")
def byte_tokenizer() -> Tokenizer:
    return make_byte_tokenizer()
