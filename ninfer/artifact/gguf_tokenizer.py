"""Rebuild a `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata.

A GGUF carries the vocabulary (tokens, merges, token types) and names its pre-tokenizer
(`tokenizer.ggml.pre`) instead of shipping tokenizer.json. We rebuild what llama.cpp
runs: the pre-tokenizer's split regexes in order, byte-level BPE, and control /
user-defined tokens as added tokens matched before the model. When the file embeds
the original tokenizer.json (`tokenizer.huggingface.json`) that is used verbatim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE


class GGUFTokenizerError(ValueError):
    """The tokenizer metadata is missing, inconsistent or of an unsupported kind."""


# llama.cpp token types (gguf.TokenType)
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Qwen3.5 keeps combining marks inside words.
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class PreTokenizerSpec:
    """How one `tokenizer.ggml.pre` value splits text before BPE (llama.cpp's llama-vocab.cpp)."""

    def __init__(
        self,
        regexes: Sequence[str],
        *,
        nfc: bool = False,
        ignore_merges: bool = False,
        add_bos: bool = False,
    ):
        self.regexes = tuple(regexes)  # applied in order, each splitting the previous pieces
        self.nfc = nfc  # the original HF tokenizer normalizes to NFC first (Qwen)
        self.ignore_merges = ignore_merges  # a piece that is a whole vocab entry is taken as is (Llama 3)
        self.add_bos = add_bos  # llama.cpp's default when the file does not say


_LLAMA3_SPEC = PreTokenizerSpec((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_SPEC = PreTokenizerSpec((_QWEN2,), nfc=True)
_GPT2_SPEC = PreTokenizerSpec((_GPT2,))
# Digits one by one, then GPT-2 splitting (StarCoder-style vocabularies, SmolLM).
_DIGITS_GPT2_SPEC = PreTokenizerSpec((r"\p{N}", _GPT2))

PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3_SPEC),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _QWEN2_SPEC),
    "qwen35": PreTokenizerSpec((_QWEN35,), nfc=True),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"), _GPT2_SPEC),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva-7b"), _DIGITS_GPT2_SPEC),
}


def _token_id(metadata: Mapping[str, Any], key: str, num_tokens: int) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    value = int(value)
    if not 0 <= value < num_tokens:
        raise GGUFTokenizerError(f"{key}={value} is outside the vocabulary of {num_tokens} tokens")
    return value


def _merge_pairs(merges: Sequence[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise GGUFTokenizerError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))
    return pairs


def _byte_level_bpe(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    pre_name = metadata.get("tokenizer.ggml.pre")
    spec = PRE_TOKENIZERS.get(pre_name) if isinstance(pre_name, str) else None
    if spec is None:
        raise GGUFTokenizerError(
            f"unsupported pre-tokenizer tokenizer.ggml.pre={pre_name!r} (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFTokenizerError("tokenizer.ggml.tokens holds duplicate tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if not merges:
        raise GGUFTokenizerError("gpt2 tokenizer without tokenizer.ggml.merges")
    backend = tokenizers.Tokenizer(
        BPE(vocab, _merge_pairs(merges), fuse_unk=False, byte_fallback=False, ignore_merges=spec.ignore_merges)
    )
    if spec.nfc:
        backend.normalizer = normalizers.NFC()
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False) for regex in spec.regexes]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()

    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is not None and len(token_types) != len(tokens):
        raise GGUFTokenizerError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens")
    # Control tokens are special (skipped when decoding with skip_special_tokens);
    # user-defined ones (e.g. <think>) are matched whole but decode as text.
    added = [
        AddedToken(tokens[i], special=token_type == TOKEN_CONTROL, normalized=False)
        for i, token_type in enumerate(token_types or ())
        if token_type in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    ]
    if added:
        backend.add_tokens(added)
    return backend


def build_gguf_tokenizer(metadata: Mapping[str, Any]) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """-> (backend, tokenizer_config): the config names bos/eos/pad/unk tokens and add_bos_token.

    Raises GGUFTokenizerError for missing or unsupported tokenizer metadata.
    """
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFTokenizerError("no tokenizer.ggml.tokens (the file carries no tokenizer)")
    model = metadata.get("tokenizer.ggml.model")
    embedded = metadata.get("tokenizer.huggingface.json")
    if isinstance(embedded, str) and embedded:
        try:
            backend = tokenizers.Tokenizer.from_str(embedded)
        except Exception as error:  # tokenizers raises plain Exception subclasses
            raise GGUFTokenizerError(f"tokenizer.huggingface.json does not parse: {error}") from error
    elif model == "gpt2":
        backend = _byte_level_bpe(metadata)
    else:
        raise GGUFTokenizerError(f"unsupported tokenizer model tokenizer.ggml.model={model!r} (supported: gpt2)")

    num_tokens = len(tokens)
    config: dict[str, Any] = {}
    for name, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ):
        token_id = _token_id(metadata, key, num_tokens)
        config[name] = tokens[token_id] if token_id is not None else None
    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        spec = PRE_TOKENIZERS.get(metadata.get("tokenizer.ggml.pre", ""))
        add_bos = bool(spec and spec.add_bos)
    config["add_bos_token"] = bool(add_bos)
    return backend, config
