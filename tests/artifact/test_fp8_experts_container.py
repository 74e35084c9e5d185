"""`ninfer pack --weights fp8` of MoE models: the FP8 experts travel in the container (their
scale layout in the manifest) and load back as they were packed; broken expert entries fail at
open naming the module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ninfer.artifact import ArtifactError, open_artifact
from ninfer.artifact.ninfer_file import read_header, verify_container
from ninfer.artifact.packer import pack
from ninfer.models.quant.fp8 import SCALE_BLOCK, quantize_fp8_
from ninfer.models.quant.fp8_experts import Fp8Experts
from ninfer.models.runtime_layout import FP8_EXPERTS, runtime_tensors
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.artifact.test_ninfer_file import _rewrite_metadata, _same_tensors
from tests.models.fp8_experts_checkpoint import fp8_moe_checkpoint
from tests.models.helpers import run_full

TRUNK, MTP = "model.layers.0.mlp.experts", "mtp.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fp8-experts-containers")


# bf16 experts: quantize_fp8_ quantizes them per output row (rows_per_block null). The FP8
# checkpoint (I = 32) keeps its fused trunk experts' 128 x 128 blocks and its per-expert MTP
# experts' blocks as row blocks.
@pytest.mark.parametrize("source_kind, trunk_rows, mtp_rows", [("bf16", None, None), ("fp8", SCALE_BLOCK, 1)])
def test_fp8_packing_stores_and_reloads_fp8_experts(root, source_kind: str, trunk_rows, mtp_rows) -> None:
    if source_kind == "bf16":
        source = make_tiny_qwen3_5(root, moe=True, mtp=True)
    else:
        source = fp8_moe_checkpoint(root, 32)
    out = root / f"tiny-moe-{source_kind}.ninfer"
    pack(source, out, weights="fp8", progress=False)
    packed = open_artifact(out)
    modules = packed.manifest["weights"]["modules"]
    assert modules[TRUNK] == {"kind": FP8_EXPERTS, "rows_per_block": trunk_rows}
    assert modules[MTP] == {"kind": FP8_EXPERTS, "rows_per_block": mtp_rows}
    assert verify_container(out, progress=False) == []
    # The server's own build of the source with --quantize fp8 holds the same bits.
    expected = open_artifact(source).load_model(dtype=torch.bfloat16, progress=False, keep_fp8=True)
    quantize_fp8_(expected)
    model = packed.load_model(dtype=torch.bfloat16, progress=False)
    _same_tensors(runtime_tensors(model), runtime_tensors(expected))
    for name in (TRUNK, MTP):
        assert isinstance(model.get_submodule(name), Fp8Experts)
        assert model.get_submodule(name).rows_per_block("down_proj") == modules[name]["rows_per_block"]
    prompt = torch.arange(2000, 2016)
    assert torch.equal(run_full(model, prompt), run_full(expected, prompt))


def test_broken_fp8_expert_entries_fail_at_open(root) -> None:
    out = root / "tiny-moe-entries.ninfer"
    pack(make_tiny_qwen3_5(root, moe=True), out, weights="fp8", progress=False)
    manifest = json.loads(read_header(out)["__metadata__"]["manifest.json"])
    modules = manifest["weights"]["modules"]

    def with_modules(name: str, changed: dict) -> Path:
        weights = {**manifest["weights"], "modules": {**modules, **changed}}
        return _rewrite_metadata(out, root / f"{name}.ninfer", manifest_json=json.dumps({**manifest, "weights": weights}))

    with pytest.raises(ArtifactError, match=f"{TRUNK}.*64 rows per scale"):
        open_artifact(with_modules("rows", {TRUNK: {"kind": FP8_EXPERTS, "rows_per_block": 64}}))
    shared = "model.layers.0.mlp.shared_expert.down_proj"
    with pytest.raises(ArtifactError, match=f"{shared}.*not fused experts"):
        open_artifact(with_modules("not-experts", {shared: {"kind": FP8_EXPERTS, "rows_per_block": None}}))
    # Recorded as per-row scales, stored as per-row scales: a 128-block record mismatches the tensors.
    with pytest.raises(ArtifactError, match=f"{TRUNK}.gate_up_proj_scale"):
        open_artifact(with_modules("blocks", {TRUNK: {"kind": FP8_EXPERTS, "rows_per_block": SCALE_BLOCK}}))
