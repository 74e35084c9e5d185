"""`ninfer write-checkpoint --weights bf16|fp8|nvfp4`: a random-weight checkpoint in the stored
layout of the published quantized checkpoints, sharded with its index, holding the bf16
weights within each format's rounding and opened by the same loader as the downloads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ninfer.artifact import open_artifact
from ninfer.bench.checkpoint import write_random_checkpoint
from ninfer.kernels.nvfp4_gemv import dequantize_nvfp4
from ninfer.models.quant.fp8 import Fp8Linear
from ninfer.models.quant.nvfp4 import Nvfp4Linear
from ninfer.models.vision_loader import load_vision_tower
from tests.models.helpers import run_full

PROMPT = torch.arange(100, 140)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("random-checkpoints")
    # Small shards, so the index spreads the quantized tensors' scales over several files.
    return {weights: write_random_checkpoint("tiny", root / weights, device="cpu", shard_bytes=1 << 20,
                                             weights=weights)
            for weights in ("bf16", "fp8", "nvfp4")}


def _stored(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(directory.glob("model-*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def test_the_index_names_every_stored_tensor_and_its_shard(checkpoints) -> None:
    for weights, directory in checkpoints.items():
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        shards = {directory / name for name in index["weight_map"].values()}
        assert len(shards) > 1 and all(shard.exists() for shard in shards), weights
        assert index["metadata"]["total_size"] == sum(shard.stat().st_size for shard in shards) - sum(
            8 + int.from_bytes(shard.read_bytes()[:8], "little") for shard in shards)
        assert set(index["weight_map"]) == set(_stored(directory)), weights
    assert "model.layers.0.mlp.down_proj.weight_scale_inv" in _stored(checkpoints["fp8"])
    assert "model.layers.3.self_attn.q_proj.weight_scale_2" in _stored(checkpoints["nvfp4"])
    assert (checkpoints["nvfp4"] / "hf_quant_config.json").exists()


def test_the_stored_weights_are_the_bf16_weights_within_each_formats_rounding(checkpoints) -> None:
    # Relative RMS error of one rounding: e4m3 (3 mantissa bits) about 2.6%, e2m1 about 10%.
    bf16 = _stored(checkpoints["bf16"])
    fp8, nvfp4 = _stored(checkpoints["fp8"]), _stored(checkpoints["nvfp4"])
    quantized = [name for name in bf16 if name + "_scale_inv" in fp8]
    assert len(quantized) > 20 and "lm_head.weight" not in quantized
    for name in quantized:
        weight = bf16[name].float()
        rows, cols = weight.shape
        scale = fp8[name + "_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
        fp8_error = (fp8[name].float() * scale - weight).norm() / weight.norm()
        nvfp4_weight = dequantize_nvfp4(nvfp4[name], nvfp4[name + "_scale"], nvfp4[name + "_scale_2"].expand(rows))
        nvfp4_error = (nvfp4_weight - weight).norm() / weight.norm()
        assert 0 < fp8_error < 0.035 and 0 < nvfp4_error < 0.12, (name, fp8_error, nvfp4_error)
    for name in set(bf16) - set(quantized):
        assert torch.equal(fp8[name], bf16[name]) and torch.equal(nvfp4[name], bf16[name]), name


def test_each_format_loads_into_its_native_layers(checkpoints) -> None:
    for weights, layer_type, keep in (("fp8", Fp8Linear, "keep_fp8"), ("nvfp4", Nvfp4Linear, "keep_nvfp4")):
        model = open_artifact(checkpoints[weights]).load_model(dtype=torch.float32, progress=False, **{keep: True})
        assert isinstance(model.model.layers[0].mlp.down_proj, layer_type), weights
        assert isinstance(model.model.layers[3].self_attn.qkv_proj, layer_type), weights
        assert not isinstance(model.lm_head, layer_type), weights
        with torch.no_grad():
            assert torch.isfinite(run_full(model, PROMPT)).all(), weights


def test_vision_adds_the_tower_which_loads_complete(tmp_path) -> None:
    directory = write_random_checkpoint("tiny", tmp_path / "vl", device="cpu", weights="fp8", vision=True)
    artifact = open_artifact(directory)
    tower = load_vision_tower(artifact, "cpu", torch.float32)  # raises on a missing or extra tensor
    assert tower.config.out_hidden_size == artifact.config.hidden_size
    stored = _stored(directory)
    qkv = "model.visual.blocks.0.attn.qkv.weight"
    assert stored[qkv].dtype == torch.bfloat16 and qkv + "_scale_inv" not in stored  # the tower stays bf16
    assert torch.equal(tower.blocks[0].attn.qkv.weight, stored[qkv].float())


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_open(tmp_path, monkeypatch) -> None:
    from ninfer.artifact import ArtifactError
    from ninfer.bench.shapes import SHAPES

    # Weights of 4096 rows beside the 248k-id tokenizer: a token past row 4095 would fail a step.
    monkeypatch.setitem(SHAPES, "tiny", {**SHAPES["tiny"], "vocab_size": 4096})
    directory = write_random_checkpoint("tiny", tmp_path / "small-vocab", device="cpu")
    with pytest.raises(ArtifactError, match="tokenizer has .* token ids but the model embeds only 4096"):
        open_artifact(directory)


def test_bench_fp8_blocks_hold_what_the_loader_makes_of_the_qwen_fp8_checkpoint(checkpoints) -> None:
    from ninfer.models.quant.fp8 import quantize_fp8_blocks_

    # `ninfer bench --weights fp8-block` quantizes in memory; the server loads the checkpoint.
    loaded = open_artifact(checkpoints["fp8"]).load_model(dtype=torch.float32, progress=False, keep_fp8=True)
    quantized = open_artifact(checkpoints["bf16"]).load_model(dtype=torch.float32, progress=False)
    assert quantize_fp8_blocks_(quantized) > 0
    modules = dict(quantized.named_modules())
    compared = 0
    for name, module in loaded.named_modules():
        if isinstance(module, Fp8Linear):
            ours = modules[name]
            assert isinstance(ours, Fp8Linear) and ours.block_scaled, name
            assert torch.equal(ours.weight.view(torch.uint8), module.weight.view(torch.uint8)), name
            assert torch.equal(ours.weight_scale, module.weight_scale), name
            compared += 1
    assert compared == sum(isinstance(m, Fp8Linear) for m in quantized.modules()) > 0


def test_fp8_block_experts_keep_128x128_scales_and_the_weights_within_e4m3_rounding() -> None:
    from ninfer.models.layers.moe import Experts
    from ninfer.models.quant.fp8_experts import Fp8Experts

    experts = Experts(num_experts=4, hidden_size=256, intermediate_size=192)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(experts.down_proj, std=0.05)
    fp8 = Fp8Experts.from_experts_blocks(experts)
    assert fp8.gate_up_proj_scale.shape == (4, 3, 2) and fp8.down_proj_scale.shape == (4, 2, 2)
    assert fp8.rows_per_block("gate_up_proj") == 128
    for name in ("gate_up_proj", "down_proj"):
        weight, scale = getattr(experts, name).detach(), fp8.scale_of(name)
        expanded = scale.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, : weight.shape[1], : weight.shape[2]]
        error = (getattr(fp8, name).float() * expanded - weight).norm() / weight.norm()
        assert 0 < error < 0.035, (name, error)


def test_bench_options_refuse_an_unknown_weight_format() -> None:
    from ninfer.bench.suite import BenchOptions

    with pytest.raises(ValueError, match="unknown --weights fp9"):
        BenchOptions(weights=["bf16", "fp9"])


def test_a_constant_output_checkpoint_accepts_every_draft_of_its_mtp_head(tmp_path) -> None:
    """--constant-output: the output norms zero, so every greedy token is id 0 and the real MTP
    head drafts it; speculative rounds accept every draft (served figures at full acceptance)."""
    from ninfer.config import EngineConfig
    from ninfer.contract.request import EngineRequest
    from ninfer.contract.sampling import SamplingParams
    from ninfer.engine.core import EngineCore

    directory = write_random_checkpoint("tiny", tmp_path / "constant", device="cpu", mtp=True, constant_output=True)
    stored = _stored(directory)
    assert torch.equal(stored["model.norm.weight"], torch.full_like(stored["model.norm.weight"], -1.0))
    assert torch.equal(stored["mtp.norm.weight"], torch.full_like(stored["mtp.norm.weight"], -1.0))
    assert stored["model.layers.0.input_layernorm.weight"].abs().sum() > 0  # every other norm random
    artifact = open_artifact(str(directory))
    model = artifact.load_model(dtype=torch.float32, device="cpu")
    limit = 23
    for spec in ({}, {"spec": "mtp", "draft_tokens": 3, "adaptive_drafts": False}):
        core = EngineCore(model, artifact.tokenizer, EngineConfig(max_concurrency=2, max_context=256, **spec))
        core.add_request(EngineRequest("r", list(range(100, 140)), SamplingParams(temperature=0.0), max_new_tokens=limit))
        tokens, final = [], None
        while core.has_work:
            for out in core.step():
                tokens += out.new_token_ids
                final = out if out.finished else final
        assert tokens == [0] * limit
        if spec:
            counters = final.speculative
            assert counters.accepted_tokens == counters.drafted_tokens > 0
            assert counters.rounds <= -(-(limit - 1) // 4) + 1  # 4 tokens a round at full acceptance
