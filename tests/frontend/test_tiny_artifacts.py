"""Tiny random Qwen3.5 artifacts: real layout and tokenizer, load in transformers, stay small."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ninfer.assets import chat_template_source
from ninfer.assets.qwen_tokenizer import build_qwen3_5_tokenizer, qwen3_5_tokenizer_json
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5

VARIANTS: dict[str, dict[str, Any]] = {
    "dense_text": {},
    "moe_text_mtp": {"moe": True, "mtp": True},
    "dense_vl_mtp": {"vision": True, "mtp": True},
    "moe_vl_qwen3_8": {"moe": True, "vision": True, "template": "qwen3_8"},
}
HIDDEN = 64
MAX_WEIGHT_BYTES = 40 * 2**20  # the tied 248,320 x 64 bf16 embedding is 31.8 MB of it
MAX_ARTIFACT_BYTES = 60 * 2**20  # + the 12 MB tokenizer.json


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_artifacts")


@pytest.fixture(scope="module")
def artifacts(root: Path) -> dict[str, Path]:
    return {name: make_tiny_qwen3_5(root, **kwargs) for name, kwargs in VARIANTS.items()}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def _config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def _load_hf(path: Path, vision: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    import transformers as tf

    cls = tf.AutoModelForImageTextToText if vision else tf.AutoModelForCausalLM
    return cls.from_pretrained(path, output_loading_info=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_loads_in_transformers_with_every_weight_and_finite_logits(artifacts: dict[str, Path], name: str) -> None:
    path, vision = artifacts[name], VARIANTS[name].get("vision", False)
    model, info = _load_hf(path, vision)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    stored = _tensors(path)
    state = model.state_dict()
    for key, tensor in stored.items():
        if key.startswith("mtp."):
            continue  # transformers does not implement MTP
        loaded = key if vision else key.replace("model.language_model.", "model.", 1)
        assert torch.equal(state[loaded], tensor), key
    tokens = build_qwen3_5_tokenizer().encode("<|im_start|>user\nHello 世界<|im_end|>\n", add_special_tokens=False).ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits.float()
    assert logits.shape == (1, len(tokens), 248_320)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1 and not torch.equal(logits[0, 0], logits[0, -1])


def test_vision_tower_runs_on_an_image(artifacts: dict[str, Path]) -> None:
    model, _ = _load_hf(artifacts["dense_vl_mtp"], vision=True)
    # One 32x32 image: 2x2 patches of 16 px, merged 2x2 into a single <|image_pad|> token.
    pixel_values = torch.randn(4, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0))
    input_ids = torch.tensor([[248045, 846, 198, 248053, 248056, 248054, 248046]])
    token_types = (input_ids == 248056).long()  # 1 marks image tokens for the 3-D (MRoPE) positions
    with torch.no_grad():
        with_image = model(
            input_ids=input_ids,
            pixel_values=pixel_values.to(model.dtype),
            image_grid_thw=torch.tensor([[1, 2, 2]]),
            mm_token_type_ids=token_types,
        ).logits
        text_only = model(input_ids=input_ids).logits
    assert torch.isfinite(with_image.float()).all()
    assert not torch.equal(with_image[0, -1], text_only[0, -1])  # the image embedding reached the trunk


@pytest.mark.parametrize("name", list(VARIANTS))
def test_layout_config_and_size(artifacts: dict[str, Path], name: str) -> None:
    path, kwargs = artifacts[name], VARIANTS[name]
    tensors = _tensors(path)
    names = set(tensors)
    assert any(n.startswith("model.language_model.layers.0.linear_attn.") for n in names)
    assert any(n.startswith("model.language_model.layers.3.self_attn.") for n in names)
    assert not any(n.startswith(("model.layers.", "lm_head")) for n in names)  # hub layout, tied head
    assert tensors["model.language_model.embed_tokens.weight"].shape == (248_320, HIDDEN)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert any(n.startswith("model.visual.") for n in names) == bool(kwargs.get("vision"))
    if kwargs.get("moe"):
        assert tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, HIDDEN)
        assert tensors["model.language_model.layers.0.mlp.experts.down_proj"].shape == (4, HIDDEN, 32)

    config = _config(path)
    text = config.get("text_config", config)
    assert text["vocab_size"] == 248_320 and text["hidden_size"] == HIDDEN
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["tie_word_embeddings"] is True
    assert (
        config["model_type"]
        == {
            (False, False): "qwen3_5_text",
            (True, False): "qwen3_5_moe_text",
            (False, True): "qwen3_5",
            (True, True): "qwen3_5_moe",
        }[bool(kwargs.get("moe")), bool(kwargs.get("vision"))]
    )
    assert text.get("mtp_num_hidden_layers", 0) == (1 if kwargs.get("mtp") else 0)

    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [248_046, 248_044] and generation["pad_token_id"] == 248_044
    assert (generation["temperature"], generation["top_k"], generation["top_p"]) == (1.0, 20, 0.95)
    assert (path / "chat_template.jinja").read_text() == chat_template_source(kwargs.get("template", "qwen3_5"))
    assert (path / "tokenizer.json").read_text() == qwen3_5_tokenizer_json()

    weight_bytes = (path / "model.safetensors").stat().st_size
    total_bytes = sum(f.stat().st_size for f in path.iterdir())
    assert weight_bytes < MAX_WEIGHT_BYTES and total_bytes < MAX_ARTIFACT_BYTES, (weight_bytes, total_bytes)


def test_norms_are_random_not_identity(artifacts: dict[str, Path]) -> None:
    tensors = {k: v.float() for k, v in _tensors(artifacts["dense_vl_mtp"]).items()}
    for key in (
        "model.language_model.norm.weight",
        "model.language_model.layers.0.input_layernorm.weight",
        "model.language_model.layers.0.linear_attn.norm.weight",
        "model.language_model.layers.3.self_attn.q_norm.weight",
        "mtp.norm.weight",
        "model.visual.blocks.0.norm1.weight",
    ):
        assert tensors[key].std() > 0.05, key
    # (1 + w) norms centre on 0; plain w-norms (GDN output, vision LayerNorm) centre on 1.
    assert abs(tensors["model.language_model.norm.weight"].mean()) < 0.3
    assert abs(tensors["model.language_model.layers.0.linear_attn.norm.weight"].mean() - 1) < 0.3


@pytest.mark.parametrize("name", ["moe_text_mtp", "dense_vl_mtp"])
def test_mtp_tensors(artifacts: dict[str, Path], name: str) -> None:
    tensors = _tensors(artifacts[name])
    mtp = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    assert mtp["mtp.fc.weight"].shape == (HIDDEN, 2 * HIDDEN)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert mtp[f"mtp.{norm}.weight"].shape == (HIDDEN,)
    # The MTP layer is a full-attention decoder layer shaped like the trunk's (layer 3).
    for part in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
        trunk = tensors[f"model.language_model.layers.3.self_attn.{part}.weight"]
        assert mtp[f"mtp.layers.0.self_attn.{part}.weight"].shape == trunk.shape, part
    assert mtp["mtp.layers.0.self_attn.q_proj.weight"].shape == (2 * 2 * 32, HIDDEN)  # query + output gate
    for norm in ("input_layernorm", "post_attention_layernorm"):
        assert mtp[f"mtp.layers.0.{norm}.weight"].shape == (HIDDEN,)
    if VARIANTS[name].get("moe"):
        fused = tensors["model.language_model.layers.3.mlp.experts.gate_up_proj"]
        for expert in range(4):
            gate = mtp[f"mtp.layers.0.mlp.experts.{expert}.gate_proj.weight"]
            assert gate.shape == (fused.shape[1] // 2, fused.shape[2])  # trunk experts fuse gate and up
            assert mtp[f"mtp.layers.0.mlp.experts.{expert}.up_proj.weight"].shape == (32, HIDDEN)
            assert mtp[f"mtp.layers.0.mlp.experts.{expert}.down_proj.weight"].shape == (HIDDEN, 32)
        assert mtp["mtp.layers.0.mlp.gate.weight"].shape == (4, HIDDEN)
        assert mtp["mtp.layers.0.mlp.shared_expert.down_proj.weight"].shape == (HIDDEN, 32)
        assert mtp["mtp.layers.0.mlp.shared_expert_gate.weight"].shape == (1, HIDDEN)
        assert len(mtp) == 4 + 2 + 6 + 1 + 4 * 3 + 3 + 1
    else:
        for part in ("gate_proj", "up_proj", "down_proj"):
            assert (
                mtp[f"mtp.layers.0.mlp.{part}.weight"].shape
                == tensors[f"model.language_model.layers.3.mlp.{part}.weight"].shape
            )
        assert len(mtp) == 15  # as in the Qwen3.6-27B checkpoint


def test_mtp_does_not_change_the_trunk(artifacts: dict[str, Path], root: Path) -> None:
    with_mtp = _tensors(artifacts["dense_vl_mtp"])
    without = _tensors(make_tiny_qwen3_5(root, vision=True))
    assert set(with_mtp) - set(without) == {k for k in with_mtp if k.startswith("mtp.")}
    for key, tensor in without.items():
        assert torch.equal(with_mtp[key], tensor), key


def test_cached_by_parameters(artifacts: dict[str, Path], root: Path) -> None:
    start = time.perf_counter()
    again = make_tiny_qwen3_5(root, moe=True, mtp=True)
    assert again == artifacts["moe_text_mtp"] and time.perf_counter() - start < 0.5
    assert len(set(artifacts.values())) == len(artifacts)
    other_seed = make_tiny_qwen3_5(root, seed=1)
    assert other_seed != artifacts["dense_text"]
    with (
        safe_open(other_seed / "model.safetensors", "pt") as a,
        safe_open(artifacts["dense_text"] / "model.safetensors", "pt") as b,
    ):
        key = "model.language_model.norm.weight"
        assert not torch.equal(a.get_tensor(key), b.get_tensor(key))
    with pytest.raises(ValueError):
        make_tiny_qwen3_5(root, template="qwen9")  # type: ignore[arg-type]
