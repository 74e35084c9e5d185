"""Hugging Face model directories: sharded weights, templates, generation defaults, identity, errors."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import tokenizers
import torch
from safetensors.torch import load_file, save_file
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM

from ninfer.artifact import ArtifactError, open_artifact
from ninfer.models.forward_batch import ForwardBatch

VOCAB = 64
# \r\n, trailing spaces and non-ASCII text must survive byte for byte
JINJA_TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>\r\n{% endfor %}  \n# ünïcödé  "
CONFIG_TEMPLATE = "{{ messages[0]['content'] }} (from tokenizer_config)"


def _write_tokenizer(directory: Path, **config: object) -> None:
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    backend = tokenizers.Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    backend.save(str(directory / "tokenizer.json"))
    tokenizer_config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, **config}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


@pytest.fixture(scope="module")
def source() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=2,
        bos_token_id=1,
    )
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    return model


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory, source: LlamaForCausalLM) -> Path:
    """A valid single-file artifact without template, generation config or manifest."""
    directory = tmp_path_factory.mktemp("base") / "tiny-llama"
    source.save_pretrained(directory)
    (directory / "generation_config.json").unlink(missing_ok=True)
    _write_tokenizer(directory)
    return directory


@pytest.fixture()
def copy_of(base_dir: Path, tmp_path: Path) -> Callable[[str], Path]:
    def make(name: str) -> Path:
        return Path(shutil.copytree(base_dir, tmp_path / name))

    return make


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    kv_cache, _ = model.allocate_caches(2, 8, 0)
    batch = ForwardBatch.build(
        [len(ids)], [0], torch.arange(2)[None], [0], kv_cache, None, logits_indices=list(range(len(ids)))
    )
    with torch.no_grad():
        return model.compute_logits(model(ids, batch))


def test_sharded_checkpoint_loads_lazily(tmp_path: Path, source: LlamaForCausalLM) -> None:
    directory = tmp_path / "sharded"
    source.save_pretrained(directory, max_shard_size="20KB")
    _write_tokenizer(directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not (directory / "model.safetensors").exists()

    artifact = open_artifact(directory)
    assert artifact.kind == "hf_directory" and artifact.num_tensors == len(index["weight_map"])
    weights = artifact.weights()
    name, first = next(weights)  # lazy: one tensor at a time, in HF naming
    assert name in index["weight_map"] and isinstance(first, torch.Tensor)
    model = artifact.load_model(dtype=torch.float32, progress=False)
    ids = torch.tensor([1, 5, 9, 33, 2, 7, 63])
    with torch.no_grad():
        expected = source(ids[None]).logits[0]
    torch.testing.assert_close(_logits(model, ids), expected, atol=2e-5, rtol=0)


def test_tokenizer_from_directory(base_dir: Path) -> None:
    tokenizer = open_artifact(base_dir).tokenizer
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2 and tokenizer.add_bos_token
    assert tokenizer.encode("w0 w1", add_special_tokens=True) == [1, 3, 4]


def test_chat_template_precedence_and_bytes(copy_of: Callable[[str], Path]) -> None:
    assert open_artifact(copy_of("none")).chat_template is None

    from_config = copy_of("from_config")
    _write_tokenizer(from_config, chat_template=CONFIG_TEMPLATE)
    assert open_artifact(from_config).chat_template == CONFIG_TEMPLATE

    both = copy_of("both")
    _write_tokenizer(both, chat_template=CONFIG_TEMPLATE)
    (both / "chat_template.jinja").write_bytes(JINJA_TEMPLATE.encode("utf-8"))
    assert open_artifact(both).chat_template == JINJA_TEMPLATE  # the .jinja file wins, \r\n kept

    named = copy_of("named")
    _write_tokenizer(
        named,
        chat_template=[
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": CONFIG_TEMPLATE},
        ],
    )
    assert open_artifact(named).chat_template == CONFIG_TEMPLATE


def test_generation_defaults(copy_of: Callable[[str], Path], base_dir: Path) -> None:
    # without generation_config.json the config's eos still stops generation
    assert open_artifact(base_dir).generation_defaults == {"eos_token_id": [2]}
    directory = copy_of("generation")
    (directory / "generation_config.json").write_text(
        json.dumps(
            {
                "do_sample": True,
                "temperature": 0.6,
                "top_p": 0.95,
                "top_k": 20,
                "eos_token_id": [2, 1],
                "transformers_version": "5.17.0",
            }
        )
    )
    assert open_artifact(directory).generation_defaults == {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "eos_token_id": [2, 1],
    }


def test_model_id_from_manifest_or_directory_name(copy_of: Callable[[str], Path], base_dir: Path) -> None:
    assert open_artifact(base_dir).model_id == "tiny-llama"
    directory = copy_of("renamed-on-disk")
    (directory / "ninfer.json").write_text(json.dumps({"model_id": "acme/Tiny-Llama-1"}))
    assert open_artifact(directory).model_id == "acme/Tiny-Llama-1"


def test_declared_mtp_without_weights_loads_without_mtp(
    copy_of: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    # MTP weights are often stripped from published checkpoints (the model type does not matter here)
    directory = copy_of("stripped-mtp")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    with caplog.at_level(logging.INFO, logger="ninfer.artifact"):
        artifact = open_artifact(directory)
    assert artifact.config.mtp_num_hidden_layers == 0
    assert artifact.hf_config["mtp_num_hidden_layers"] == 1
    assert any("mtp" in record.getMessage().lower() for record in caplog.records)


def _error(path: Path) -> str:
    with pytest.raises(ArtifactError) as error:
        open_artifact(path)
    return str(error.value)


def _edit_json(path: Path, change: Callable[[dict], dict]) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def test_errors_name_the_file(copy_of: Callable[[str], Path], tmp_path: Path, source: LlamaForCausalLM) -> None:
    assert str(tmp_path / "nowhere") in _error(tmp_path / "nowhere")

    d = copy_of("no-config")
    (d / "config.json").unlink()
    assert f"{d / 'config.json'}: missing" in _error(d)

    d = copy_of("bad-json")
    (d / "config.json").write_text('{"model_type": "llama",')
    assert f"{d / 'config.json'}: invalid JSON" in _error(d)

    d = copy_of("gpt2")
    _edit_json(d / "config.json", lambda c: {**c, "model_type": "gpt2"})
    message = _error(d)
    assert str(d / "config.json") in message and "unsupported model_type 'gpt2'" in message

    d = copy_of("no-weights")
    (d / "model.safetensors").unlink()
    assert str(d) in _error(d) and "model.safetensors" in _error(d)

    d = copy_of("corrupt-weights")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    assert f"{d / 'model.safetensors'}: unreadable safetensors file" in _error(d)

    d = tmp_path / "missing-shard"
    source.save_pretrained(d, max_shard_size="20KB")
    _write_tokenizer(d)
    shard = max(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values())
    (d / shard).unlink()
    message = _error(d)
    assert str(d / "model.safetensors.index.json") in message and shard in message

    d = copy_of("missing-tensor")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    message = _error(d)
    assert str(d) in message and "model.layers.1.mlp.up_proj.weight" in message

    d = copy_of("mis-shaped")
    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, d / "model.safetensors")
    message = _error(d)
    assert str(d) in message and "model.norm.weight" in message and "(31,)" in message

    d = copy_of("no-tokenizer")
    (d / "tokenizer.json").unlink()
    assert f"{d / 'tokenizer.json'}: missing" in _error(d)

    d = copy_of("bad-tokenizer")
    (d / "tokenizer.json").write_text('{"model": {"type": "Nope"}}')
    assert f"{d / 'tokenizer.json'}: cannot load tokenizer" in _error(d)

    d = copy_of("bad-tokenizer-config")
    (d / "tokenizer_config.json").write_text("[1, 2")
    assert f"{d / 'tokenizer_config.json'}: invalid JSON" in _error(d)

    d = copy_of("no-default-template")
    _write_tokenizer(d, chat_template=[{"name": "tool_use", "template": "x"}])
    message = _error(d)
    assert str(d / "tokenizer_config.json") in message and "default" in message

    d = copy_of("bad-generation-config")
    (d / "generation_config.json").write_text("{")
    assert f"{d / 'generation_config.json'}: invalid JSON" in _error(d)

    d = copy_of("bad-manifest")
    (d / "ninfer.json").write_text(json.dumps({"model_id": ""}))
    assert str(d / "ninfer.json") in _error(d)


def test_block_scaled_fp8_checkpoint_is_dequantized_exactly(tmp_path):
    """Qwen FP8 layout: e4m3 weights + weight_scale_inv per 128x128 block (here 4x4 for a tiny model)."""
    import json as _json

    import torch as _torch
    from safetensors.torch import load_file, save_file

    from ninfer.artifact import open_artifact as _open
    from ninfer.artifact.safetensors_weights import dequantize_block_fp8

    hf = _make_fp8_source(tmp_path / "bf16")
    config = _json.loads((hf / "config.json").read_text())
    tensors = load_file(hf / "model.safetensors")
    stored, expected = {}, {}
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and "embed" not in name and name != "lm_head.weight":
            rows, cols = tensor.shape
            scale_inv = _torch.rand((rows + 3) // 4, (cols + 3) // 4) * 0.01 + 0.001
            q = (tensor.float() / scale_inv.repeat_interleave(4, 0)[:rows].repeat_interleave(4, 1)[:, :cols])
            stored[name] = q.clamp(-448, 448).to(_torch.float8_e4m3fn)
            stored[name + "_scale_inv"] = scale_inv
            expected[name] = dequantize_block_fp8(stored[name], scale_inv, (4, 4))
        else:
            stored[name] = tensor
            expected[name] = tensor
    out = tmp_path / "fp8"
    out.mkdir()
    for extra in hf.iterdir():
        if extra.name != "model.safetensors":
            (out / extra.name).write_bytes(extra.read_bytes())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [4, 4]}
    (out / "config.json").write_text(_json.dumps(config))
    save_file(stored, out / "model.safetensors")
    artifact = _open(out)
    got = dict(artifact.weights())
    assert not any(n.endswith("_scale_inv") for n in got) and artifact.num_tensors == len(expected)
    for name, tensor in expected.items():
        assert _torch.equal(got[name], tensor), name
    artifact.load_model(dtype=_torch.bfloat16, progress=False)  # every parameter filled, none unknown


def _make_fp8_source(directory):
    import transformers as _tf

    from tests.models.helpers import randomize_

    model = _tf.LlamaForCausalLM(_tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                                 num_hidden_layers=1, num_attention_heads=2,
                                                 num_key_value_heads=1)).to(__import__("torch").bfloat16)
    randomize_(model, 3, vector_mean=1.0)
    model.save_pretrained(directory)
    _write_tokenizer(directory)
    return directory


def test_block_scaled_fp8_checkpoint_kept_in_fp8(tmp_path):
    """Qwen's 128x128 layout loaded natively: packed projections become Fp8Linear with per-row
    block scales; stored FP8 parts are kept bit for bit, an unquantized part (v_proj here) is
    quantized per row and 128 columns, and lm_head / embeddings stay unquantized."""
    import json as _json

    import torch as _torch
    from safetensors.torch import load_file, save_file

    from ninfer.artifact import open_artifact as _open
    from ninfer.models.quant.fp8 import Fp8Linear

    hf = _make_fp8_source(tmp_path / "bf16")
    config = _json.loads((hf / "config.json").read_text())
    tensors = load_file(hf / "model.safetensors")
    stored = {}
    for name, tensor in tensors.items():
        quantize = tensor.dim() == 2 and "embed" not in name and name != "lm_head.weight" and "v_proj" not in name
        if quantize:
            scale_inv = tensor.float().abs().amax().reshape(1, 1) / 448  # one 128x128 block holds it all
            stored[name] = (tensor.float() / scale_inv).clamp(-448, 448).to(_torch.float8_e4m3fn)
            stored[name + "_scale_inv"] = scale_inv
        else:
            stored[name] = tensor
    out = tmp_path / "fp8"
    out.mkdir()
    for extra in hf.iterdir():
        if extra.name != "model.safetensors":
            (out / extra.name).write_bytes(extra.read_bytes())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (out / "config.json").write_text(_json.dumps(config))
    save_file(stored, out / "model.safetensors")

    artifact = _open(out)
    assert "model.layers.0.self_attn.q_proj.weight" in artifact.fp8_weights
    assert "model.layers.0.self_attn.v_proj.weight" not in artifact.fp8_weights
    dequantized = dict(artifact.weights())  # the bf16 path
    model = artifact.load_model(dtype=_torch.float32, progress=False, keep_fp8=True)
    layer = model.model.layers[0]
    qkv, gate_up, down = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
    assert all(isinstance(m, Fp8Linear) for m in (qkv, gate_up, down))
    assert not isinstance(model.lm_head, Fp8Linear)
    assert qkv.weight_scale.shape == (qkv.weight.shape[0], 1)  # one scale per row and 128 columns
    q_rows, kv_rows = 2 * 16, 16
    qkv_weight = qkv.dequantized(_torch.float32)
    # Stored FP8 parts: exactly the checkpoint's values (compared at the bf16 the other path yields).
    assert _torch.equal(qkv_weight[:q_rows].bfloat16(), dequantized["model.layers.0.self_attn.q_proj.weight"])
    assert _torch.equal(
        qkv_weight[q_rows : q_rows + kv_rows].bfloat16(), dequantized["model.layers.0.self_attn.k_proj.weight"]
    )
    gate = dequantized["model.layers.0.mlp.gate_proj.weight"]
    assert _torch.equal(gate_up.dequantized(_torch.float32)[: gate.shape[0]].bfloat16(), gate)
    # The unquantized v_proj part: e4m3 with its own per-row scale, within 2^-4 of each row's max.
    v_stored = tensors["model.layers.0.self_attn.v_proj.weight"].float()
    v_error = (qkv_weight[q_rows + kv_rows :] - v_stored).abs().amax(dim=1)
    assert (v_error <= v_stored.abs().amax(dim=1) * 2**-4).all() and v_error.max() > 0
