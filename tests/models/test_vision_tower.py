"""Qwen3.5 vision tower: parity with transformers' Qwen3_5VisionModel, batching, loading.

Tolerances: fp32 merged embeddings within atol 2e-5 of transformers (|out| ~ 3; observed
~3e-6, from the patch matmul vs Conv3d and the summation order of the resampled position grid).
bf16: both bf16 towers against transformers' fp32 output, ours within 1.5x of transformers' error
(observed 0.021 vs 0.020 max abs on |out| ~ 3).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from ninfer.artifact import ArtifactError, open_artifact
from ninfer.models.loader import WeightLoadError
from ninfer.models.vision import VisionTower, merged_tokens
from ninfer.models.vision_config import VisionConfig
from ninfer.models.vision_loader import build_vision_tower, load_vision_tower, load_vision_weights
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.models.helpers import normal_init, randomize_

ATOL = 2e-5
VISUAL = "model.visual."


@pytest.fixture(scope="module")
def artifact_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vision-artifacts")


@pytest.fixture(scope="module")
def vl_artifact(artifact_root) -> Path:
    return make_tiny_qwen3_5(artifact_root, vision=True, dtype="float32")


@pytest.fixture(scope="module")
def vl_tensors(vl_artifact) -> dict[str, torch.Tensor]:
    return load_file(vl_artifact / "model.safetensors")


def reference_tower(hf_vision: dict, tensors: dict[str, torch.Tensor], prefix: str) -> tf.Qwen3_5VisionModel:
    model = tf.Qwen3_5VisionModel(tf.Qwen3_5VisionConfig(**hf_vision)).eval()
    state = {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}
    model.load_state_dict(state, strict=True)
    return model


@pytest.fixture(scope="module")
def tiny_pair(vl_artifact, vl_tensors) -> tuple[VisionTower, tf.Qwen3_5VisionModel]:
    artifact = open_artifact(vl_artifact)
    ours = load_vision_tower(artifact, "cpu", torch.float32)
    return ours, reference_tower(artifact.hf_config["vision_config"], vl_tensors, VISUAL)


# depth 2, 4 heads, a 6 x 6 position grid, a text width unlike the vision width
WIDE_VISION = dict(
    depth=2,
    hidden_size=64,
    intermediate_size=96,
    num_heads=4,
    out_hidden_size=48,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=36,
)


@pytest.fixture(scope="module")
def wide_pair() -> tuple[VisionTower, tf.Qwen3_5VisionModel]:
    """A depth-2 tower built by transformers, stored under the older `visual.` prefix."""
    torch.manual_seed(0)
    reference = tf.Qwen3_5VisionModel(tf.Qwen3_5VisionConfig(**WIDE_VISION)).eval()
    # LayerNorm weights centred on 1 (the rest N(0, 0.3)) so no norm sits at its identity.
    randomize_(reference, seed=3, overrides={"norm1.weight": normal_init(1, 0.2), "norm2.weight": normal_init(1, 0.2),
                                             "norm.weight": normal_init(1, 0.2)})
    stored = {f"visual.{name}": t.clone() for name, t in reference.state_dict().items()}
    config = VisionConfig.from_hf({"vision_config": {**WIDE_VISION, "hidden_act": "gelu_pytorch_tanh"}})
    ours = build_vision_tower(config, torch.float32)
    load_vision_weights(ours, stored.items(), source="wide")
    return ours.eval(), reference


def patches_for(grids: list[tuple[int, int, int]], patch_dim: int, seed: int = 0) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, patch_dim, generator=torch.Generator().manual_seed(seed))


def compare(pair, grids: list[tuple[int, int, int]]) -> float:
    ours, reference = pair
    patches = patches_for(grids, ours.config.patch_dim)
    with torch.no_grad():
        expected = reference(patches, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(patches, grids)
    assert got.shape == expected.shape == (sum(merged_tokens(g, 2) for g in grids), ours.config.out_hidden_size)
    assert got.dtype == torch.float32
    return (got - expected).abs().max().item()


GRIDS = {
    "image-4x6": [(1, 4, 6)],
    "image-8x8": [(1, 8, 8)],
    "image-tall-10x4": [(1, 10, 4)],
    "two-images": [(1, 4, 6), (1, 8, 8)],
    "video-3-steps": [(3, 4, 4)],
    "images-and-video": [(1, 2, 2), (2, 6, 4), (1, 4, 6)],
}


@pytest.mark.parametrize("grids", GRIDS.values(), ids=GRIDS.keys())
def test_tiny_tower_matches_transformers(tiny_pair, grids):
    assert compare(tiny_pair, grids) < ATOL


@pytest.mark.parametrize("grids", [[(1, 6, 8)], [(1, 4, 6), (2, 8, 8), (1, 12, 2)]], ids=["image", "mixed"])
def test_depth2_tower_matches_transformers(wide_pair, grids):
    assert compare(wide_pair, grids) < ATOL


def test_batched_items_equal_separate_calls(tiny_pair):
    """Attention stays within each frame: an item's embeddings do not depend on its batch mates."""
    ours, _ = tiny_pair
    grids = [(1, 4, 6), (2, 4, 4), (1, 8, 8)]
    patches = patches_for(grids, ours.config.patch_dim, seed=1)
    with torch.no_grad():
        batched = ours(patches, grids)
        rows = [t * h * w for t, h, w in grids]
        separate = torch.cat([ours(p, [g]) for p, g in zip(patches.split(rows), grids)])
    assert (batched - separate).abs().max().item() < 1e-5


def test_bf16_tower_is_as_accurate_as_transformers_bf16(tiny_pair, vl_tensors, vl_artifact):
    """bf16 runs of both, each against transformers' fp32 output: ours no less accurate (x1.5 slack)."""
    ours32, reference32 = tiny_pair
    grids = [(1, 4, 6), (2, 8, 8)]
    patches = patches_for(grids, ours32.config.patch_dim, seed=2)
    ours16 = load_vision_tower(open_artifact(vl_artifact), "cpu", torch.bfloat16)
    reference16 = reference_tower(json.loads((vl_artifact / "config.json").read_text())["vision_config"],
                                  vl_tensors, VISUAL).to(torch.bfloat16)
    with torch.no_grad():
        truth = reference32(patches, grid_thw=torch.tensor(grids)).pooler_output
        ours_error = (ours16(patches, grids).float() - truth).abs().max().item()
        reference_error = (reference16(patches.bfloat16(), grid_thw=torch.tensor(grids)).pooler_output.float()
                           - truth).abs().max().item()
    assert ours16(patches, grids).dtype == torch.bfloat16
    # the rotary frequencies stay fp32 however the tower is cast
    assert torch.equal(ours16.layout(grids).cos, ours32.layout(grids).cos)
    assert ours_error <= 1.5 * reference_error + 1e-3


def test_patch_count_must_match_grids(tiny_pair):
    ours, _ = tiny_pair
    with pytest.raises(ValueError, match="need \\(24, 1536\\)"):
        ours(torch.zeros(23, 1536), [(1, 4, 6)])
    with pytest.raises(ValueError, match="multiples of 2"):
        ours(torch.zeros(15, 1536), [(1, 3, 5)])


# ---- loading -------------------------------------------------------------------------------------


def test_loaded_parameters_equal_checkpoint_tensors(vl_artifact, vl_tensors):
    tower = load_vision_tower(open_artifact(vl_artifact), "cpu", torch.float32)
    params = dict(tower.named_parameters())
    stored = {name.removeprefix(VISUAL): t for name, t in vl_tensors.items() if name.startswith(VISUAL)}
    assert sorted(params) == sorted(stored)
    for name, tensor in stored.items():
        assert torch.equal(params[name].detach(), tensor), name
    assert not tower.training


def test_bf16_load_rounds_each_tensor_once(vl_artifact, vl_tensors):
    tower = load_vision_tower(open_artifact(vl_artifact), "cpu", torch.bfloat16)
    weight = tower.get_parameter("blocks.0.attn.qkv.weight")
    assert weight.dtype == torch.bfloat16
    assert torch.equal(weight.detach(), vl_tensors[VISUAL + "blocks.0.attn.qkv.weight"].bfloat16())


def test_text_only_artifact_has_no_tower(artifact_root):
    artifact = open_artifact(make_tiny_qwen3_5(artifact_root, vision=False, dtype="float32"))
    with pytest.raises(ArtifactError, match="no vision_config"):
        load_vision_tower(artifact, "cpu", torch.float32)


def artifact_with_tensors(source: Path, target: Path, keep) -> Path:
    """A copy of `source` whose safetensors keeps only the tensors `keep` accepts."""
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if keep(n)}, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_artifact_without_vision_tensors_names_them(vl_artifact, tmp_path):
    stripped = artifact_with_tensors(vl_artifact, tmp_path / "stripped", lambda name: not name.startswith(VISUAL))
    artifact = open_artifact(stripped)  # the trunk still opens: it never needed the tower
    with pytest.raises(WeightLoadError, match=r"holds no vision tower tensors \(model\.visual\.\* or visual\.\*\)"):
        load_vision_tower(artifact, "cpu", torch.float32)


def test_missing_vision_tensor_is_named(vl_artifact, tmp_path):
    missing = VISUAL + "blocks.0.attn.qkv.bias"
    partial = artifact_with_tensors(vl_artifact, tmp_path / "partial", lambda name: name != missing)
    with pytest.raises(WeightLoadError, match=r"vision tower\): 1 parameters were not loaded: blocks\.0\.attn\.qkv\.bias"):
        load_vision_tower(open_artifact(partial), "cpu", torch.float32)


def test_misshaped_vision_tensor_is_named(tiny_pair, vl_tensors):
    ours, _ = tiny_pair
    tensors = dict(vl_tensors)
    tensors[VISUAL + "pos_embed.weight"] = torch.zeros(9, 32)
    tower = build_vision_tower(ours.config, torch.float32)
    with pytest.raises(WeightLoadError, match=r"'model\.visual\.pos_embed\.weight' has shape \(9, 32\)"):
        load_vision_weights(tower, tensors.items())
