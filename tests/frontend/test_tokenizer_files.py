"""A tokenizer.json is parsed once per content in a process: the same file opened again, or a copy of
it in another artifact, shares the parsed backend; other contents and every wrapper's own settings
stay separate."""

from __future__ import annotations

import tokenizers

from ninfer.frontend import tokenizer as tokenizer_module
from ninfer.frontend.tokenizer import Tokenizer


def _write(path, vocab: dict[str, int]):
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path.write_text(backend.to_str())
    return path


def test_a_tokenizer_file_is_parsed_once_per_content(tmp_path, monkeypatch) -> None:
    parses = []
    from_str = tokenizers.Tokenizer.from_str
    monkeypatch.setattr(tokenizers.Tokenizer, "from_str", lambda text: parses.append(1) or from_str(text))
    monkeypatch.setattr(tokenizer_module, "_parsed", type(tokenizer_module._parsed)())
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    first = _write(tmp_path / "a.json", vocab)
    copy = tmp_path / "copy.json"
    copy.write_bytes(first.read_bytes())
    other = _write(tmp_path / "b.json", {**vocab, "again": 3})

    a = Tokenizer.from_files(first, {"eos_token": "world"})
    b = Tokenizer.from_files(copy, {"eos_token": "hello"})
    assert len(parses) == 1 and a.backend is b.backend
    assert (a.eos_token_id, b.eos_token_id) == (2, 1)  # each wrapper keeps its own config
    c = Tokenizer.from_files(other)
    assert len(parses) == 2 and c.backend is not a.backend
    assert a.encode("hello world again") == [1, 2, 0] and c.encode("hello world again") == [1, 2, 3]


def test_only_the_most_recent_parsed_files_are_kept(tmp_path, monkeypatch) -> None:
    parses = []
    from_str = tokenizers.Tokenizer.from_str
    monkeypatch.setattr(tokenizers.Tokenizer, "from_str", lambda text: parses.append(1) or from_str(text))
    monkeypatch.setattr(tokenizer_module, "_parsed", type(tokenizer_module._parsed)())
    kept = tokenizer_module._PARSED_KEPT
    paths = [_write(tmp_path / f"{i}.json", {"[UNK]": 0, f"word{i}": 1}) for i in range(kept + 1)]
    for path in paths:
        Tokenizer.from_files(path)
    assert len(parses) == kept + 1 and len(tokenizer_module._parsed) == kept
    Tokenizer.from_files(paths[-1])  # recent: kept
    assert len(parses) == kept + 1
    Tokenizer.from_files(paths[0])  # the oldest was let go: parsed again
    assert len(parses) == kept + 2
