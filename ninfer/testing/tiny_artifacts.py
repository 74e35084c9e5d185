"""Tiny random Qwen3.5 artifacts with the real tokenizer, for tests and local runs.

An artifact is an HF directory shaped like a real Qwen3.5 / 3.6 / 3.8 release: config.json
(composite `qwen3_5` / `qwen3_5_moe` with a tiny vision tower, or the flat text config),
model.safetensors in the hub layout (`model.language_model.*`, `model.visual.*`, `mtp.*`),
generation_config.json, the real 248,077-id tokenizer and one of our chat templates. The
trunk is tiny (hidden 64, 4 layers: 3 Gated DeltaNet + 1 gated attention) but keeps the real
248,320-row padded vocabulary; embeddings are tied so that matrix is stored once (~32 MB bf16).

transformers builds the trunk (it is the reference the engine is tested against); it does not
implement MTP, so the `mtp.*` tensors are generated here with the shapes of the hub checkpoints.
Every weight, norms included, is random (seeded), so no norm sits at an identity value that
would hide a loading bug.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from ninfer.assets.qwen_tokenizer import EMBEDDING_ROWS, write_qwen3_5_tokenizer

# Bump when the files written change, so cached artifacts are rebuilt.
_GENERATOR_VERSION = 1

TemplateName = Literal["qwen3_5", "qwen3_8"]

IM_END_ID = 248_046
ENDOFTEXT_ID = 248_044

TEXT = dict(
    vocab_size=EMBEDDING_ROWS,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    max_position_embeddings=262_144,
    rms_norm_eps=1e-6,
    # Real Qwen3.5 rotary: 1/4 of head_dim, interleaved MRoPE sections summing to rotary_dim / 2.
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    tie_word_embeddings=True,
    eos_token_id=IM_END_ID,
    pad_token_id=ENDOFTEXT_ID,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# Real patch geometry (16 px, temporal 2, merge 2) so the real image processor settings apply.
VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
)
GENERATION_CONFIG = {
    "do_sample": True,
    "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
    "pad_token_id": ENDOFTEXT_ID,
    "temperature": 1.0,
    "top_k": 20,
    "top_p": 0.95,
}
# Qwen3.5 preprocessor_config.json / video_preprocessor_config.json values.
PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 16_777_216, "shortest_edge": 65_536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
VIDEO_PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 25_165_824, "shortest_edge": 4_096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}
_COMPLETE_MARKER = ".ninfer-complete"


@dataclass(frozen=True)
class TinySpec:
    moe: bool = False
    mtp: bool = False
    vision: bool = False
    template: TemplateName = "qwen3_5"
    seed: int = 0
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        parts = ["qwen3_5", "moe" if self.moe else "dense", "vl" if self.vision else "text"]
        if self.mtp:
            parts.append("mtp")
        parts += [self.template, f"s{self.seed}", self.dtype]
        key = json.dumps({**asdict(self), "version": _GENERATOR_VERSION}, sort_keys=True)
        return "-".join(parts) + "-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def make_tiny_qwen3_5(
    directory: str | os.PathLike[str],
    *,
    moe: bool = False,
    mtp: bool = False,
    vision: bool = False,
    template: TemplateName = "qwen3_5",
    seed: int = 0,
    dtype: str = "bfloat16",
) -> Path:
    """A tiny random Qwen3.5 artifact under the cache root `directory`, built once per parameter set.

    Returns the artifact directory. Parallel callers may race; each builds in a private
    directory and the first rename wins.
    """
    if template not in ("qwen3_5", "qwen3_8"):
        raise ValueError(f"template must be 'qwen3_5' or 'qwen3_8', not {template!r}")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, not {dtype!r}")
    spec = TinySpec(moe=moe, mtp=mtp, vision=vision, template=template, seed=seed, dtype=dtype)
    root = Path(directory)
    target = root / spec.name
    if (target / _COMPLETE_MARKER).exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{spec.name}-"))
    try:
        _write_artifact(staging, spec)
        (staging / _COMPLETE_MARKER).write_text(json.dumps(asdict(spec)) + "\n")
        if target.exists():
            shutil.rmtree(target)  # an incomplete leftover of a crashed build
        os.rename(staging, target)
    except OSError:
        if not (target / _COMPLETE_MARKER).exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# ---- building -----------------------------------------------------------------------------------


def _write_artifact(out: Path, spec: TinySpec) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    model = _random_model(spec)
    model.to(getattr(torch, spec.dtype)).save_pretrained(out)

    weight_files = sorted(out.glob("*.safetensors"))
    if len(weight_files) != 1 or (out / "model.safetensors.index.json").exists():
        raise RuntimeError(f"expected one safetensors file, got {[p.name for p in weight_files]}")
    tensors = load_file(weight_files[0])
    weight_files[0].unlink()
    if not spec.vision:
        # The hub text-only layout matches the VLM one (transformers strips `language_model.`).
        tensors = {_vlm_name(name): tensor for name, tensor in tensors.items()}
    if spec.moe:
        tensors = _fuse_trunk_experts(tensors)
    if spec.mtp:
        text_config = model.config.get_text_config()
        tensors.update(_mtp_tensors(text_config, spec, getattr(torch, spec.dtype)))
    save_file(dict(sorted(tensors.items())), out / "model.safetensors", metadata={"format": "pt"})

    config = json.loads((out / "config.json").read_text())
    text = config.get("text_config", config)
    if spec.mtp:
        text["mtp_num_hidden_layers"] = 1
        text["mtp_use_dedicated_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    if spec.vision:
        (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
        (out / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR_CONFIG, indent=2) + "\n")
    write_qwen3_5_tokenizer(out, spec.template)


def _vlm_name(name: str) -> str:
    if name.startswith("model.") and not name.startswith("model.language_model."):
        return "model.language_model." + name.removeprefix("model.")
    return name


_PER_EXPERT = re.compile(
    r"^(?P<prefix>model\.language_model\.layers\.\d+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$"
)


def _fuse_trunk_experts(tensors: dict[str, Any]) -> dict[str, Any]:
    """Hub trunk layout: `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I].

    transformers saves routed experts one file entry per expert; the released checkpoints
    store them fused (their MTP layer keeps the per-expert form).
    """
    import torch

    fused: dict[str, Any] = {}
    per_layer: dict[str, dict[tuple[int, str], Any]] = {}
    for name, tensor in tensors.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            fused[name] = tensor
        else:
            per_layer.setdefault(match["prefix"], {})[(int(match["expert"]), match["proj"])] = tensor
    for prefix, parts in per_layer.items():
        experts = range(1 + max(expert for expert, _ in parts))
        fused[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat((parts[e, "gate"], parts[e, "up"])) for e in experts])
        fused[f"{prefix}.down_proj"] = torch.stack([parts[e, "down"] for e in experts])
    return fused


def _random_model(spec: TinySpec) -> Any:
    import torch
    import transformers as tf

    text = {**TEXT, **(MOE if spec.moe else {})}
    if spec.vision:
        vision = {**VISION, "out_hidden_size": TEXT["hidden_size"]}
        config_cls = tf.Qwen3_5MoeConfig if spec.moe else tf.Qwen3_5Config
        model_cls = tf.Qwen3_5MoeForConditionalGeneration if spec.moe else tf.Qwen3_5ForConditionalGeneration
        config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=True)
    else:
        config_cls = tf.Qwen3_5MoeTextConfig if spec.moe else tf.Qwen3_5TextConfig
        model_cls = tf.Qwen3_5MoeForCausalLM if spec.moe else tf.Qwen3_5ForCausalLM
        config = config_cls(**text)
    config.dtype = spec.dtype
    torch.manual_seed(spec.seed)
    model = model_cls(config).eval()
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            param.copy_(_random_tensor(name, tuple(param.shape), generator))
    return model


def _random_tensor(name: str, shape: tuple[int, ...], generator: Any) -> Any:
    """Matrices N(0, fan_in^-1/2) keep activations O(1); vectors by role, never at identity."""
    import torch

    if name.endswith("A_log"):
        return torch.log(torch.rand(shape, generator=generator) * 1.99 + 0.01)  # decays A in [0.01, 2]
    if len(shape) >= 2:
        fan_in = 1
        for size in shape[1:]:
            fan_in *= size
        return torch.randn(shape, generator=generator) * fan_in**-0.5
    plain_norm = name.endswith("linear_attn.norm.weight") or (".visual." in f".{name}" and "norm" in name)
    if plain_norm and name.endswith("weight"):
        return torch.randn(shape, generator=generator) * 0.2 + 1.0  # w·x/rms norms: centred on 1
    if name.endswith("bias"):
        return torch.randn(shape, generator=generator) * 0.02
    return torch.randn(shape, generator=generator) * 0.3  # (1+w) norms, dt_bias


def _mtp_shapes(text_config: Any, moe: bool) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the hub `mtp.*` tensors (one full-attention layer)."""
    hidden = text_config.hidden_size
    heads, kv_heads, head_dim = text_config.num_attention_heads, text_config.num_key_value_heads, text_config.head_dim
    yield "mtp.fc.weight", (hidden, 2 * hidden)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        yield f"mtp.{norm}.weight", (hidden,)
    layer = "mtp.layers.0"
    yield f"{layer}.input_layernorm.weight", (hidden,)
    yield f"{layer}.post_attention_layernorm.weight", (hidden,)
    yield f"{layer}.self_attn.q_proj.weight", (2 * heads * head_dim, hidden)  # query and output gate
    yield f"{layer}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden)
    yield f"{layer}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden)
    yield f"{layer}.self_attn.o_proj.weight", (hidden, heads * head_dim)
    yield f"{layer}.self_attn.q_norm.weight", (head_dim,)
    yield f"{layer}.self_attn.k_norm.weight", (head_dim,)
    if not moe:
        inter = text_config.intermediate_size
        yield f"{layer}.mlp.gate_proj.weight", (inter, hidden)
        yield f"{layer}.mlp.up_proj.weight", (inter, hidden)
        yield f"{layer}.mlp.down_proj.weight", (hidden, inter)
        return
    inter, shared = text_config.moe_intermediate_size, text_config.shared_expert_intermediate_size
    yield f"{layer}.mlp.gate.weight", (text_config.num_experts, hidden)
    for expert in range(text_config.num_experts):
        yield f"{layer}.mlp.experts.{expert}.gate_proj.weight", (inter, hidden)
        yield f"{layer}.mlp.experts.{expert}.up_proj.weight", (inter, hidden)
        yield f"{layer}.mlp.experts.{expert}.down_proj.weight", (hidden, inter)
    yield f"{layer}.mlp.shared_expert.gate_proj.weight", (shared, hidden)
    yield f"{layer}.mlp.shared_expert.up_proj.weight", (shared, hidden)
    yield f"{layer}.mlp.shared_expert.down_proj.weight", (hidden, shared)
    yield f"{layer}.mlp.shared_expert_gate.weight", (1, hidden)


def _mtp_tensors(text_config: Any, spec: TinySpec, dtype: Any) -> dict[str, Any]:
    import torch

    # A separate stream, so adding MTP leaves the trunk weights of the same seed unchanged.
    generator = torch.Generator().manual_seed(spec.seed + 1_000_003)
    return {
        name: _random_tensor(name, shape, generator).to(dtype).contiguous()
        for name, shape in _mtp_shapes(text_config, spec.moe)
    }
