"""NVIDIA ModelOpt NVFP4 checkpoints: detected from their quantization config, kept as stored in
Nvfp4Linear layers (codes and block scales bit for bit, each part's global scale on its rows),
or dequantized exactly; logits of the native model match dequantize-then-compute; --quantize nvfp4 and `pack --weights nvfp4` build the same model; malformed
configs fail at open naming the file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ninfer.artifact import ArtifactError, open_artifact
from ninfer.artifact.packer import pack
from ninfer.config import EngineConfig
from ninfer.contract.request import EngineRequest
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.builder import EngineSpec, build_engine_core
from ninfer.kernels.nvfp4_gemv import dequantize_nvfp4
from ninfer.models.layers.linear import PackedLinear
from ninfer.models.quant.nvfp4 import Nvfp4Linear, quantize_nvfp4_
from ninfer.models.runtime_layout import runtime_tensors
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from ninfer.testing.tiny_quantized import modelopt_nvfp4_copy
from tests.models.helpers import run_chunked, run_full

PROMPT = torch.arange(3000, 3024)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen3_5(tmp_path_factory.mktemp("nvfp4-src"))


@pytest.fixture(scope="module")
def nvfp4_dir(tiny, tmp_path_factory):
    return modelopt_nvfp4_copy(tiny, tmp_path_factory.mktemp("nvfp4") / "tiny-nvfp4")


def test_the_checkpoint_opens_with_its_nvfp4_weights_named(nvfp4_dir) -> None:
    artifact = open_artifact(nvfp4_dir)
    names = set(artifact.nvfp4_weights)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in names
    stored = load_file(nvfp4_dir / "model.safetensors")
    name = "model.language_model.layers.0.mlp.down_proj.weight"
    assert artifact.nvfp4_weights[name] == (stored[name].shape[0], stored[name].shape[1] * 2)
    # The dequantizing path: fp32 products rounded once to bf16; scales never reach the model.
    weights = dict(artifact.weights())
    assert not any(n.endswith(("_scale", "_scale_2", "input_scale")) for n in weights)
    rows = stored[name].shape[0]
    expected = dequantize_nvfp4(stored[name], stored[name + "_scale"], stored[name + "_scale_2"].expand(rows))
    assert torch.equal(weights[name], expected.bfloat16())


def test_native_nvfp4_layers_hold_the_checkpoint_bits(nvfp4_dir) -> None:
    artifact = open_artifact(nvfp4_dir)
    model = artifact.load_model(dtype=torch.float32, progress=False, keep_nvfp4=True)
    stored = load_file(nvfp4_dir / "model.safetensors")
    layer = model.model.layers[3]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, Nvfp4Linear) and isinstance(layer.mlp.gate_up_proj, Nvfp4Linear)
    assert not isinstance(model.lm_head, Nvfp4Linear)
    start = 0
    for part in ("q_proj", "k_proj", "v_proj"):
        name = f"model.language_model.layers.3.self_attn.{part}.weight"
        rows = slice(start, start + stored[name].shape[0])
        start = rows.stop
        assert torch.equal(qkv.weight[rows], stored[name])
        assert torch.equal(qkv.block_scale[rows].view(torch.uint8), stored[name + "_scale"].view(torch.uint8))
        assert torch.all(qkv.row_scale[rows] == stored[name + "_scale_2"])  # each part its own global scale
    assert start == qkv.out_features


def _dense_copy(model):
    """The model with each Nvfp4Linear replaced by a packed bf16-free Linear of its fp32 dequantized weight."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Nvfp4Linear):
            dense = PackedLinear(module.in_features, module.parts or {"weight": module.out_features})
            dense.weight.data = module.dequantized(torch.float32)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, dense)
    return model


def test_native_logits_match_dequantize_then_compute(nvfp4_dir) -> None:
    """Against the fp32 dequantized weights: equal up to summation order. Against the checkpoint
    dequantized to bf16 (each weight rounded by 2^-9): the rounding moves this random tiny
    model's logits by 2.3% of their spread on average (measured), so only the mean is bounded,
    at 5% (a wrong nibble order or scale moves them by their whole spread)."""
    artifact = open_artifact(nvfp4_dir)
    native = artifact.load_model(dtype=torch.float32, progress=False, keep_nvfp4=True)
    dense = _dense_copy(artifact.load_model(dtype=torch.float32, progress=False, keep_nvfp4=True))
    rounded = artifact.load_model(dtype=torch.float32, progress=False, keep_nvfp4=False)
    for run in (run_full, lambda model, ids: run_chunked(model, ids, [1])):  # prefill, and GEMV decode steps
        ours, reference = run(native, PROMPT), run(dense, PROMPT)
        spread = reference.std()
        assert (ours - reference).abs().max() <= 1e-5 * spread
        assert (ours - run(rounded, PROMPT)).abs().mean() <= 5e-2 * spread


def _greedy(core, num_tokens: int) -> list[int]:
    core.add_request(EngineRequest("r", PROMPT.tolist(), SamplingParams(temperature=0.0), max_new_tokens=num_tokens))
    tokens: list[int] = []
    while core.has_work:
        for output in core.step():
            tokens.extend(output.new_token_ids)
    return tokens


def test_quantize_nvfp4_and_pack_nvfp4_build_the_same_model(nvfp4_dir, tiny, tmp_path) -> None:
    config = EngineConfig(max_context=128, log_stats_interval_ms=0)
    served = build_engine_core(EngineSpec(str(nvfp4_dir), config, quantize="nvfp4"))
    out = tmp_path / "tiny.ninfer"
    report = pack(nvfp4_dir, out, weights="nvfp4", progress=False)
    packed = open_artifact(out)
    assert report.quantized_modules == len(packed.manifest["weights"]["modules"]) == 16
    from_container = build_engine_core(EngineSpec(str(out), config))
    expected = open_artifact(nvfp4_dir).load_model(dtype=torch.bfloat16, progress=False, keep_nvfp4=True)
    quantize_nvfp4_(expected)
    ours = runtime_tensors(packed.load_model(dtype=torch.bfloat16, progress=False))
    theirs = runtime_tensors(expected)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n].view(torch.uint8), theirs[n].view(torch.uint8)) for n in ours)
    assert _greedy(from_container, 6) == _greedy(served, 6)
    # A bf16 checkpoint quantized at load: every projection NVFP4, tokens generated.
    bf16_served = build_engine_core(EngineSpec(str(tiny), config, quantize="nvfp4"))
    assert sum(isinstance(m, Nvfp4Linear) for m in bf16_served.runner.model.modules()) == 16
    assert len(_greedy(bf16_served, 4)) == 4


def test_unsupported_modelopt_configs_fail_at_open(nvfp4_dir, tmp_path) -> None:
    def variant(name: str, **quantization) -> object:
        out = tmp_path / name
        out.mkdir()
        for item in nvfp4_dir.iterdir():
            (out / item.name).write_bytes(item.read_bytes())
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = {**config["quantization_config"], **quantization}
        (out / "config.json").write_text(json.dumps(config))
        return out

    with pytest.raises(ArtifactError, match="config.json: NVFP4 group_size 32"):
        open_artifact(variant("group32", group_size=32))
    with pytest.raises(ArtifactError, match="quant_algo 'W4A8_AWQ' is not supported"):
        open_artifact(variant("awq", quant_algo="W4A8_AWQ"))
    # Scales that do not fit their codes are named at load.
    broken = variant("scales")
    tensors = load_file(broken / "model.safetensors")
    name = "model.language_model.layers.0.mlp.down_proj.weight"
    tensors[name + "_scale"] = tensors[name + "_scale"][:, :-1].contiguous()
    from safetensors.torch import save_file

    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj.weight.*block scales"):
        open_artifact(broken).load_model(dtype=torch.float32, progress=False, keep_nvfp4=True)
