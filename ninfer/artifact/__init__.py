"""Open model artifacts: Hugging Face directories, GGUF files and .ninfer containers."""

from __future__ import annotations

import os
from pathlib import Path

from ninfer.artifact.artifact import Artifact, ArtifactError
from ninfer.artifact.default_model import default_model_path
from ninfer.artifact.gguf_file import open_gguf
from ninfer.artifact.hf_directory import open_hf_directory
from ninfer.artifact.ninfer_file import is_container, open_ninfer_file

GGUF_MAGIC = b"GGUF"


def open_artifact(path: str | os.PathLike[str], weights: bool = True) -> Artifact:
    """Open an HF model directory, a GGUF file or a .ninfer container; ArtifactError names what is wrong.

    weights=False opens the metadata only (identity, config, tokenizer, template, generation
    defaults): no tensor is read or checked, and torch is not imported.
    """
    path = Path(path).expanduser()
    artifact = _open(path, weights)
    _check_vocabulary(artifact, path)
    return artifact


def _check_vocabulary(artifact: Artifact, path: Path) -> None:
    # A token id past the embedding's rows would fail inside an engine step; refuse at start-up instead.
    token_ids, rows = artifact.tokenizer.vocab_size, artifact.config.vocab_size
    if token_ids > rows:
        raise ArtifactError(
            f"{path}: the tokenizer has {token_ids} token ids but the model embeds only {rows} (vocab_size); "
            "the tokenizer does not belong to these weights"
        )


def _open(path: Path, weights: bool) -> Artifact:
    if path.is_dir():
        return open_hf_directory(path, weights)
    if not path.exists():
        raise ArtifactError(f"{path}: does not exist")
    try:
        with path.open("rb") as handle:
            magic = handle.read(len(GGUF_MAGIC))
    except OSError as error:
        raise ArtifactError(f"{path}: cannot read ({error.strerror or error})") from error
    if magic == GGUF_MAGIC:
        return open_gguf(path, weights)
    if path.suffix == ".ninfer" or is_container(path):
        return open_ninfer_file(path, weights)
    raise ArtifactError(f"{path}: neither a model directory, a GGUF file nor a .ninfer container")


__all__ = ["Artifact", "ArtifactError", "default_model_path", "open_artifact"]
