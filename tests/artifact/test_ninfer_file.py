""".ninfer containers: `ninfer pack` round trips (HF directory, Qwen block-scaled FP8, MoE, GGUF,
vision tower, MTP head, DFlash companion), the packed model equals the source's as the server
builds it, `--weights fp8` equals `--quantize fp8`, and broken containers fail naming the problem."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ninfer import cli
from ninfer.artifact import ArtifactError, default_model_path, open_artifact
from ninfer.artifact.draft_companion import open_draft_companion
from ninfer.artifact.ninfer_file import read_header, verify_container
from ninfer.artifact.packer import pack
from ninfer.artifact.safetensors_writer import write_safetensors
from ninfer.config import EngineConfig
from ninfer.contract.request import EngineRequest
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.builder import EngineSpec, build_engine_core
from ninfer.models.loader import QUANTIZE_AT_LOAD
from ninfer.models.quant.fp8 import Fp8Linear, quantize_fp8_
from ninfer.models.runtime_layout import runtime_tensors
from ninfer.models.vision_loader import load_vision_tower
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from ninfer.testing.tiny_dflash import make_tiny_dflash
from ninfer.testing.tiny_quantized import qwen_fp8_copy
from tests.models.test_quantize_at_load import assert_same_model


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("containers")


@pytest.fixture(scope="module")
def tiny_vl_mtp(root) -> Path:
    return make_tiny_qwen3_5(root, mtp=True, vision=True)


@pytest.fixture(scope="module")
def packed_vl_mtp(root, tiny_vl_mtp) -> Path:
    out = root / "tiny-vl-mtp.ninfer"
    pack(tiny_vl_mtp, out, model_id="tiny-packed", progress=False)
    return out


def _same_tensors(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert left[name].dtype == right[name].dtype, name
        assert torch.equal(left[name].view(torch.uint8), right[name].view(torch.uint8)), name


def _greedy(core, prompt: list[int], num_tokens: int) -> list[int]:
    core.add_request(EngineRequest("r", prompt, SamplingParams(temperature=0.0), max_new_tokens=num_tokens))
    tokens: list[int] = []
    while core.has_work:
        for output in core.step():
            tokens.extend(output.new_token_ids)
    return tokens


def test_a_packed_hf_directory_holds_the_models_tensors_template_tokenizer_and_identity(
    tiny_vl_mtp, packed_vl_mtp
) -> None:
    source, packed = open_artifact(tiny_vl_mtp), open_artifact(packed_vl_mtp)
    assert packed.kind == "ninfer" and packed.model_id == "tiny-packed"
    assert packed.chat_template == source.chat_template  # byte for byte
    assert packed.generation_defaults == source.generation_defaults
    assert packed.config == source.config
    assert packed.tokenizer.to_json() == source.tokenizer.to_json()
    text = "<|im_start|>user\nBonjour, ça va? 数字 12345<|im_end|>"
    assert packed.tokenizer.encode(text) == source.tokenizer.encode(text)
    # The same model, tensor for tensor, as the server builds it from either (MTP head included).
    _same_tensors(
        runtime_tensors(packed.load_model(dtype=torch.bfloat16, progress=False)),
        runtime_tensors(source.load_model(dtype=torch.bfloat16, progress=False)),
    )
    _same_tensors(load_vision_tower(packed).state_dict(), load_vision_tower(source).state_dict())
    manifest = packed.manifest
    assert manifest["parts"] == ["mtp", "vision"] and manifest["weights"] == {"format": "bf16", "modules": {}}
    assert verify_container(packed_vl_mtp, progress=False) == []


def test_the_engine_generates_the_same_tokens_from_the_container(tiny_vl_mtp, packed_vl_mtp) -> None:
    config = EngineConfig(max_context=128, log_stats_interval_ms=0)
    prompt = list(range(1000, 1040))
    from_source = _greedy(build_engine_core(EngineSpec(str(tiny_vl_mtp), config)), prompt, 8)
    from_container = _greedy(build_engine_core(EngineSpec(str(packed_vl_mtp), config)), prompt, 8)
    assert len(from_source) == 8 and from_container == from_source


def test_the_mtp_head_loads_only_for_spec_mtp(packed_vl_mtp) -> None:
    plain = build_engine_core(EngineSpec(str(packed_vl_mtp), EngineConfig(max_context=128, log_stats_interval_ms=0)))
    assert not any(name.startswith("mtp.") for name in runtime_tensors(plain.runner.model))
    spec = EngineConfig(max_context=128, log_stats_interval_ms=0, spec="mtp", draft_tokens=2)
    core = build_engine_core(EngineSpec(str(packed_vl_mtp), spec))
    assert any(name.startswith("mtp.") for name in runtime_tensors(core.runner.model))
    assert len(_greedy(core, list(range(500, 520)), 6)) == 6


def test_fp8_packing_keeps_checkpoint_fp8_as_stored_and_equals_quantize_fp8(root, tiny_vl_mtp) -> None:
    fp8_dir = qwen_fp8_copy(tiny_vl_mtp, root / "tiny-fp8")
    out = root / "tiny-fp8.ninfer"
    report = pack(fp8_dir, out, weights="fp8", progress=False)
    packed = open_artifact(out)
    assert report.quantized_modules == len(packed.manifest["weights"]["modules"]) > 0
    assert "quantization_config" not in packed.hf_config
    # The server's own build of the FP8 checkpoint with --quantize fp8 holds the same bits.
    expected = open_artifact(fp8_dir).load_model(dtype=torch.bfloat16, progress=False, keep_fp8=True)
    stored_fp8 = {n for n, m in expected.named_modules() if isinstance(m, Fp8Linear)}
    assert stored_fp8 and all(m.block_scaled for n, m in expected.named_modules() if n in stored_fp8)
    quantize_fp8_(expected)
    model = packed.load_model(dtype=torch.bfloat16, progress=False)
    _same_tensors(runtime_tensors(model), runtime_tensors(expected))
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, Fp8Linear) and layer.mlp.gate_up_proj.block_scaled
    assert not isinstance(model.lm_head, Fp8Linear)

    config = EngineConfig(max_context=128, log_stats_interval_ms=0)
    prompt = list(range(2000, 2030))
    quantized = _greedy(build_engine_core(EngineSpec(str(fp8_dir), config, quantize="fp8")), prompt, 6)
    assert _greedy(build_engine_core(EngineSpec(str(out), config)), prompt, 6) == quantized


def test_quantize_fp8_turns_a_bf16_checkpoints_linear_layers_into_per_channel_fp8(tiny_vl_mtp, caplog) -> None:
    config = EngineConfig(max_context=128, log_stats_interval_ms=0)
    with caplog.at_level(logging.INFO, logger="ninfer.engine"):
        core = build_engine_core(EngineSpec(str(tiny_vl_mtp), config, quantize="fp8"))
    model = core.runner.model
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    # 3 GDN layers x (in_proj, out_proj, gate_up, down) + 1 attention layer x (qkv, o, gate_up, down)
    assert len(fp8) == 16 and all(not m.block_scaled for m in fp8)
    assert "--quantize fp8: 16 FP8 Linear layers (one scale per output row)" in caplog.text
    assert not isinstance(model.lm_head, Fp8Linear)
    assert len(_greedy(core, list(range(300, 320)), 4)) == 4


@pytest.mark.parametrize("moe, quantize", [(False, "fp8"), (False, "nvfp4"), (True, "fp8")])
def test_a_bf16_container_is_quantized_as_it_loads(root, packed_vl_mtp, moe: bool, quantize: str) -> None:
    """--quantize on a bf16 container: its unquantized layers (the routed experts too, for fp8)
    quantized as their tensors arrive, the bits of the container loaded then quantized."""
    path = packed_vl_mtp
    if moe:
        path = root / "tiny-moe-bf16.ninfer"
        if not path.exists():
            pack(make_tiny_qwen3_5(root, moe=True), path, progress=False)
    packed = open_artifact(path)
    expected = packed.load_model(dtype=torch.bfloat16, progress=False)
    assert QUANTIZE_AT_LOAD[quantize](expected) > 0
    assert_same_model(packed.load_model(dtype=torch.bfloat16, progress=False, quantize=quantize), expected)


def test_a_moe_model_packs_and_loads_its_fused_experts(root) -> None:
    source = make_tiny_qwen3_5(root, moe=True)
    out = root / "tiny-moe.ninfer"
    pack(source, out, progress=False)
    _same_tensors(
        runtime_tensors(open_artifact(out).load_model(dtype=torch.bfloat16, progress=False)),
        runtime_tensors(open_artifact(source).load_model(dtype=torch.bfloat16, progress=False)),
    )


def test_a_dflash_companion_travels_inside_the_container(root) -> None:
    source = make_tiny_qwen3_5(root, seed=3)
    companion_dir = make_tiny_dflash(source, "dflash2", dtype="bfloat16")
    out = root / "tiny-dflash2.ninfer"
    assert "dflash2" in pack(source, out, progress=False).parts
    packed = open_artifact(out)
    inside = open_draft_companion(out, "dflash2", packed)
    beside = open_draft_companion(source, "dflash2")
    assert inside.config == beside.config and companion_dir == beside.path
    inside.check_weights()
    _same_tensors(inside.load_model(torch.bfloat16).state_dict(), beside.load_model(torch.bfloat16).state_dict())
    config = EngineConfig(max_context=128, log_stats_interval_ms=0, spec="dflash2", draft_tokens=3)
    assert len(_greedy(build_engine_core(EngineSpec(str(out), config)), list(range(40, 60)), 6)) == 6


def test_the_default_gguf_model_packs_and_opens_with_its_tokenizer_and_template(root) -> None:
    gguf = open_artifact(default_model_path())
    out = root / "smol.ninfer"
    pack(default_model_path(), out, progress=False)
    packed = open_artifact(out)
    assert packed.model_id == gguf.model_id and packed.chat_template == gguf.chat_template
    assert packed.tokenizer.encode("Hello there, world!") == gguf.tokenizer.encode("Hello there, world!")
    assert packed.tokenizer.eos_token_id == gguf.tokenizer.eos_token_id
    # bf16 storage of the GGUF's dequantized weights: each within bf16's rounding.
    ours = runtime_tensors(packed.load_model(dtype=torch.float32, progress=False))
    theirs = runtime_tensors(gguf.load_model(dtype=torch.float32, progress=False))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor.bfloat16().float()), name


def _rewrite_metadata(path: Path, out: Path, **changes: str | None) -> Path:
    header = read_header(path)
    metadata = dict(header.pop("__metadata__"))
    metadata.pop("sha256.json")
    for key, value in changes.items():
        key = key.replace("__", "/").replace("_json", ".json")
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    tensors = load_file(path)
    write_safetensors(out, {name: tensors[name] for name in sorted(header, key=lambda n: header[n]["data_offsets"][0])}, metadata)
    return out


def test_broken_containers_fail_at_open_naming_the_problem(root, packed_vl_mtp) -> None:
    data = packed_vl_mtp.read_bytes()
    truncated = root / "truncated.ninfer"
    truncated.write_bytes(data[:-10])
    with pytest.raises(ArtifactError, match="truncated"):
        open_artifact(truncated)
    manifest = json.loads(read_header(packed_vl_mtp)["__metadata__"]["manifest.json"])
    future = _rewrite_metadata(packed_vl_mtp, root / "future.ninfer", manifest_json=json.dumps({**manifest, "format_version": 9}))
    with pytest.raises(ArtifactError, match="format version 9"):
        open_artifact(future)
    anonymous = {**manifest, "identity": {}}
    with pytest.raises(ArtifactError, match="identity.model_id"):
        open_artifact(_rewrite_metadata(packed_vl_mtp, root / "anonymous.ninfer", manifest_json=json.dumps(anonymous)))
    with pytest.raises(ArtifactError, match="tokenizer/tokenizer.json"):
        open_artifact(_rewrite_metadata(packed_vl_mtp, root / "no-tokenizer.ninfer", tokenizer__tokenizer_json=None))
    with pytest.raises(ArtifactError, match="config.json"):
        open_artifact(_rewrite_metadata(packed_vl_mtp, root / "bad-config.ninfer", config_json="{"))
    # A tensor missing, or of another shape: named.
    header = read_header(packed_vl_mtp)
    metadata = {k: v for k, v in header.pop("__metadata__").items() if k != "sha256.json"}
    tensors = load_file(packed_vl_mtp)
    missing = dict(tensors)
    del missing["model.layers.2.mlp.down_proj.weight"]
    write_safetensors(root / "missing.ninfer", missing, metadata)
    with pytest.raises(ArtifactError, match="model.layers.2.mlp.down_proj.weight"):
        open_artifact(root / "missing.ninfer")
    reshaped = {**tensors, "model.norm.weight": torch.zeros(65, dtype=torch.bfloat16)}
    write_safetensors(root / "reshaped.ninfer", reshaped, metadata)
    with pytest.raises(ArtifactError, match=r"model.norm.weight.*\[65\].*\[64\]"):
        open_artifact(root / "reshaped.ninfer")
    unknown_kind = {**manifest, "weights": {"format": "fp8", "modules": {"model.layers.0.mlp.down_proj": {"kind": "fp4"}}}}
    with pytest.raises(ArtifactError, match="down_proj.*unknown quantization 'fp4'"):
        open_artifact(_rewrite_metadata(packed_vl_mtp, root / "kind.ninfer", manifest_json=json.dumps(unknown_kind)))
    # Not a container at all.
    entry = json.dumps({"w": {"dtype": "F32", "shape": [1]}}).encode()
    (root / "no-offsets.ninfer").write_bytes(struct.pack("<Q", len(entry)) + entry)
    with pytest.raises(ArtifactError, match="no data_offsets"):
        open_artifact(root / "no-offsets.ninfer")
    stranger = root / "stranger.bin"
    stranger.write_bytes(struct.pack("<Q", 2) + b"{}")
    with pytest.raises(ArtifactError, match="neither a model directory, a GGUF file nor a .ninfer container"):
        open_artifact(stranger)


def test_verify_names_a_tensor_whose_bytes_changed(root, packed_vl_mtp) -> None:
    damaged = root / "damaged.ninfer"
    data = bytearray(packed_vl_mtp.read_bytes())
    header = read_header(packed_vl_mtp)
    start = 8 + struct.unpack("<Q", data[:8])[0]
    begin, _ = header["model.norm.weight"]["data_offsets"]
    data[start + begin] ^= 0x01
    damaged.write_bytes(bytes(data))
    open_artifact(damaged)  # structure intact: opening does not hash 50 GB of weights
    assert verify_container(damaged, progress=False) == ["model.norm.weight"]
    assert cli.main(["verify", str(damaged)]) == 1
    assert cli.main(["verify", str(packed_vl_mtp)]) == 0


def test_the_pack_command_writes_a_container_and_reports_errors(root, tiny_vl_mtp, capsys) -> None:
    out = root / "cli.ninfer"
    assert cli.main(["pack", str(tiny_vl_mtp), str(out), "--model-id", "cli-model", "--log-level", "warning"]) == 0
    assert "cli-model, bf16 weights" in capsys.readouterr().out
    assert open_artifact(out).model_id == "cli-model"
    assert cli.main(["pack", str(root / "nowhere"), str(root / "x.ninfer")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["pack", str(tiny_vl_mtp), str(root / "no-dir" / "x.ninfer")]) == 2
    assert "no such directory" in capsys.readouterr().err
