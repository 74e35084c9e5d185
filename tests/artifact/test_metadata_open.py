"""Opening an artifact without its weights (the API process): the same identity, config, tokenizer,
template and generation defaults as a full open, in every format, with no tensor read or checked."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from ninfer.artifact import ArtifactError, default_model_path, open_artifact
from ninfer.artifact.packer import pack
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5

PROMPT = "<|im_start|>user\nHello, wörld!<|im_end|>\n"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("metadata")


@pytest.fixture(scope="module")
def tiny(root) -> Path:
    return make_tiny_qwen3_5(root, mtp=True)


@pytest.fixture(scope="module")
def container(root, tiny) -> Path:
    out = root / "tiny.ninfer"
    pack(tiny, out, model_id="tiny-packed", progress=False)
    return out


@pytest.mark.parametrize("kind", ["hf-directory", "container", "gguf"])
def test_the_metadata_equals_a_full_open(kind, tiny, container):
    path = {"hf-directory": tiny, "container": container, "gguf": default_model_path()}[kind]
    full, metadata = open_artifact(path), open_artifact(path, weights=False)
    assert (metadata.path, metadata.kind, metadata.model_id) == (full.path, full.kind, full.model_id)
    assert metadata.hf_config == full.hf_config and metadata.config == full.config
    assert metadata.chat_template == full.chat_template
    assert metadata.generation_defaults == full.generation_defaults
    assert metadata.tokenizer.encode(PROMPT) == full.tokenizer.encode(PROMPT)
    assert metadata.tokenizer.eos_token_id == full.tokenizer.eos_token_id
    assert full.num_tensors > 0 and metadata.num_tensors == 0
    with pytest.raises(ArtifactError, match="opened without its weights"):
        metadata.load_model()


def test_a_missing_tensor_is_found_by_the_full_open_only(tiny, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in tiny.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.language_model.norm.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    assert open_artifact(broken, weights=False).model_id == "broken"
    with pytest.raises(ArtifactError, match="1 parameters were not loaded: model.norm.weight"):
        open_artifact(broken)
