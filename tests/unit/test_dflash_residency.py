"""Start-up checks of --spec dflash|dflash2: where the drafter companion is found, and every way a
companion can fail to fit the target names the missing or wrong part before any weight loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file, save_file

from ninfer.artifact import open_artifact
from ninfer.artifact.draft_companion import companion_locations
from ninfer.config import ConfigValueError, EngineConfig
from ninfer.engine.startup_checks import check_speculative
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from ninfer.testing.tiny_dflash import write_tiny_dflash


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_qwen3_5(str(tmp_path_factory.mktemp("residency")), dtype="float32")


@pytest.fixture
def target(tiny, tmp_path):
    """An artifact at tmp_path/model with the tiny artifact's config (the check reads nothing else)."""
    path = tmp_path / "model"
    path.mkdir()
    return SimpleNamespace(path=path, config=open_artifact(tiny).config)


def _companion(tiny: Path, directory: Path, kind: str, edit=None) -> Path:
    write_tiny_dflash(directory, tiny, kind)
    if edit is not None:
        config = json.loads((directory / "config.json").read_text())
        edit(config)
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def _check(target, kind: str = "dflash", draft_tokens: int = 4):
    return check_speculative(target, EngineConfig(spec=kind, draft_tokens=draft_tokens))


def test_no_companion_names_both_places_looked(target) -> None:
    with pytest.raises(ConfigValueError) as error:
        _check(target, "dflash2")
    message = str(error.value)
    assert "--spec dflash2" in message and "no DFLASH2 drafter companion" in message
    assert str(target.path / "dflash2") in message and str(target.path.parent / "model-dflash2") in message


def test_inside_the_artifact_wins_over_beside_it(tiny, target) -> None:
    beside = _companion(tiny, target.path.parent / "model-dflash", "dflash")
    assert _check(target).path == beside
    inside = _companion(tiny, target.path / "dflash", "dflash")
    companion = _check(target)
    assert companion.path == inside and companion.config.kind == "dflash" and companion.num_tensors > 0


def test_a_gguf_file_looks_beside_it_under_its_stem(tmp_path) -> None:
    file = tmp_path / "model-q4.gguf"
    file.write_bytes(b"GGUF")
    assert companion_locations(file, "dflash2") == (file / "dflash2", tmp_path / "model-q4-dflash2")


def _mismatch(tiny, target, kind: str, edit, draft_tokens: int = 4) -> str:
    _companion(tiny, target.path / kind, kind, edit)
    with pytest.raises(ConfigValueError) as error:
        _check(target, kind, draft_tokens)
    assert f"--spec {kind}" in str(error.value)
    return str(error.value)


def test_hidden_size_must_be_the_targets(tiny, target) -> None:
    message = _mismatch(tiny, target, "dflash", lambda c: c.update(hidden_size=32))
    assert "hidden_size 32 differs from the target's 64" in message


def test_mask_token_must_be_a_target_token(tiny, target) -> None:
    message = _mismatch(tiny, target, "dflash", lambda c: c["dflash_config"].update(mask_token_id=300_000))
    assert "mask_token_id 300000" in message


@pytest.mark.parametrize("layer_ids", [[0, 4], [1, 1]])
def test_target_layers_must_be_distinct_layers_of_the_target(tiny, target, layer_ids) -> None:
    def edit(config):
        config["dflash_config"]["target_layer_ids"] = layer_ids
    assert "target_layer_ids" in _mismatch(tiny, target, "dflash", edit)


def test_missing_dflash_fields_are_named(tiny, target) -> None:
    message = _mismatch(tiny, target, "dflash", lambda c: c["dflash_config"].pop("mask_token_id"))
    assert "missing required field dflash_config.mask_token_id" in message


def test_dflash2_fields_missing_are_named(tiny, target) -> None:
    def edit(config):
        del config["dflash_config"]["selector_rank"], config["dflash_config"]["conv_group_size"]
    message = _mismatch(tiny, target, "dflash2", edit)
    assert "DFlash2 fields missing: dflash_config.conv_group_size, dflash_config.selector_rank" in message


def test_a_dflash2_companion_is_not_served_as_dflash(tiny, target) -> None:
    _companion(tiny, target.path / "dflash", "dflash2")
    with pytest.raises(ConfigValueError, match="serve it with --spec dflash2"):
        _check(target, "dflash")


def test_selector_candidates_fit_the_rejection_rule(tiny, target) -> None:
    message = _mismatch(tiny, target, "dflash2", lambda c: c["dflash_config"].update(selector_top_k=24))
    assert "selector_top_k 24 must be in 1..20" in message


def test_draft_tokens_must_fit_the_block(tiny, target) -> None:
    _companion(tiny, target.path / "dflash", "dflash", lambda c: c["dflash_config"].update(block_size=8))
    assert _check(target, draft_tokens=7) is not None
    with pytest.raises(ConfigValueError, match=r"--draft-tokens 8 exceeds what its block of 8 drafts \(at most 7\)"):
        _check(target, draft_tokens=8)


def test_a_missing_tensor_is_named(tiny, target) -> None:
    directory = _companion(tiny, target.path / "dflash2", "dflash2")
    tensors = load_file(directory / "model.safetensors")
    del tensors["candidate_selector.successor_codebook"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ConfigValueError, match="candidate_selector.successor_codebook"):
        _check(target, "dflash2")


def test_a_target_without_intermediate_hidden_states_is_refused(tiny, target) -> None:
    _companion(tiny, target.path / "dflash", "dflash")
    target.config = target.config.replace(family="llama")
    with pytest.raises(ConfigValueError, match="does not expose its intermediate hidden states"):
        _check(target)


def test_the_companion_copies_whole(tiny, target, tmp_path) -> None:
    """A companion is self-contained: moved beside another artifact it serves that one."""
    source = _companion(tiny, tmp_path / "elsewhere", "dflash")
    shutil.copytree(source, target.path.parent / "model-dflash")
    assert _check(target).path == target.path.parent / "model-dflash"
