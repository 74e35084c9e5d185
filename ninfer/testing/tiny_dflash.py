"""Tiny random DFlash / DFlash2 drafter companions for the tiny Qwen3.5 artifacts (tests, local runs).

A companion is written beside its artifact as `<artifact>-dflash/` or `<artifact>-dflash2/`
(artifact/draft_companion.py's second location), shaped like a published drafter: config.json
(model_type qwen3, a dflash_config) and model.safetensors with the checkpoint's tensor names.
It is small (hidden = the target's 64, 2 layers) and exercises every attention flavour: a
sliding-window layer whose 6-token window the tests' contexts exceed, and a full layer; DFlash
leaves causality to the layer types (the sliding layer causal), DFlash2 sets is_causal false and
scales and soft-caps its logits. Every weight is random from the seed, norms included.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Bump when the files written change, so cached companions are rebuilt.
_GENERATOR_VERSION = 1
_COMPLETE_MARKER = ".ninfer-complete"

MASK_TOKEN_ID = 248_070
SLIDING_WINDOW = 6
DRAFT = dict(
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=SLIDING_WINDOW,
)
DFLASH_CONFIG = dict(block_size=16, mask_token_id=MASK_TOKEN_ID, target_layer_ids=[2, 0])
DFLASH2_CONFIG = dict(
    block_size=16,
    mask_token_id=MASK_TOKEN_ID,
    target_layer_ids=[1, 2, 3],
    conv_kernel_size=2,
    conv_group_size=16,
    selector_rank=8,
    selector_top_k=16,
    output_multiplier=0.5,
    final_logit_softcapping=30.0,
)


def make_tiny_dflash(artifact: str | os.PathLike[str], kind: str = "dflash", *, seed: int = 0,
                     dtype: str = "float32") -> Path:
    """The `kind` (dflash or dflash2) companion of the tiny artifact directory `artifact`, built
    once per parameter set beside it; returns its directory."""
    if kind not in ("dflash", "dflash2"):
        raise ValueError(f"kind must be 'dflash' or 'dflash2', not {kind!r}")
    artifact = Path(artifact)
    target = artifact.with_name(f"{artifact.name}-{kind}")
    key = json.dumps({"kind": kind, "seed": seed, "dtype": dtype, "version": _GENERATOR_VERSION}, sort_keys=True)
    marker = target / _COMPLETE_MARKER
    if marker.exists() and marker.read_text() == key:
        return target
    staging = Path(tempfile.mkdtemp(dir=artifact.parent, prefix=f".{target.name}-"))
    try:
        write_tiny_dflash(staging, artifact, kind, seed=seed, dtype=dtype)
        (staging / _COMPLETE_MARKER).write_text(key)
        if target.exists():
            shutil.rmtree(target)  # another parameter set, or an incomplete leftover
        os.rename(staging, target)
    except OSError:
        if not (marker.exists() and marker.read_text() == key):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_tiny_dflash(out: Path, artifact: Path, kind: str, *, seed: int = 0, dtype: str = "float32") -> None:
    """config.json and model.safetensors of a random `kind` drafter for `artifact` into `out`."""
    import torch
    from safetensors.torch import save_file

    hf = json.loads((artifact / "config.json").read_text())
    text = hf.get("text_config", hf)
    config: dict[str, Any] = {
        "architectures": ["DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": text["hidden_size"],
        "vocab_size": text["vocab_size"],
        "num_target_layers": text["num_hidden_layers"],
        "dtype": dtype,
        **DRAFT,
        "dflash_config": dict(DFLASH2_CONFIG if kind == "dflash2" else DFLASH_CONFIG),
    }
    if kind == "dflash2":
        config["is_causal"] = False
    generator = torch.Generator().manual_seed(seed + 7_919)
    tensors = {
        name: _random_tensor(name, shape, generator).to(getattr(torch, dtype)).contiguous()
        for name, shape in sorted(_shapes(config))
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def _shapes(config: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a drafter checkpoint's tensors."""
    hidden, draft = config["hidden_size"], config["dflash_config"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    inter = config["intermediate_size"]
    yield "fc.weight", (hidden, len(draft["target_layer_ids"]) * hidden)
    yield "hidden_norm.weight", (hidden,)
    yield "norm.weight", (hidden,)
    for i in range(config["num_hidden_layers"]):
        layer = f"layers.{i}"
        yield f"{layer}.input_layernorm.weight", (hidden,)
        yield f"{layer}.post_attention_layernorm.weight", (hidden,)
        yield f"{layer}.self_attn.q_proj.weight", (heads * head_dim, hidden)
        yield f"{layer}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden)
        yield f"{layer}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden)
        yield f"{layer}.self_attn.o_proj.weight", (hidden, heads * head_dim)
        yield f"{layer}.self_attn.q_norm.weight", (head_dim,)
        yield f"{layer}.self_attn.k_norm.weight", (head_dim,)
        yield f"{layer}.mlp.gate_proj.weight", (inter, hidden)
        yield f"{layer}.mlp.up_proj.weight", (inter, hidden)
        yield f"{layer}.mlp.down_proj.weight", (hidden, inter)
        if "conv_kernel_size" in draft:
            groups = hidden // draft["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                yield f"{layer}.{conv}.base_kernel", (2, draft["conv_kernel_size"], hidden)
                yield f"{layer}.{conv}.kernel_projection.weight", (2 * draft["conv_kernel_size"] * groups, hidden)
    if "selector_rank" in draft:
        rank = draft["selector_rank"]
        yield "candidate_selector.hidden_projection.weight", (rank, hidden)
        yield "candidate_selector.predecessor_codebook", (config["vocab_size"], rank)
        yield "candidate_selector.successor_codebook", (config["vocab_size"], rank)


def _random_tensor(name: str, shape: tuple[int, ...], generator: Any) -> Any:
    """Matrices N(0, fan_in^-1/2); norms (plain w) around 1; convolutions around the identity
    (tap 0 near 1, later taps small); codebooks N(0, 1), so transitions move the scores."""
    import torch

    noise = torch.randn(shape, generator=generator)
    if name.endswith("base_kernel"):
        return noise * 0.2 + torch.tensor([1.0] + [0.0] * (shape[1] - 1))[None, :, None]
    if name.endswith("_codebook"):
        return noise
    if len(shape) >= 2:
        return noise * shape[-1] ** -0.5
    return noise * 0.2 + 1.0
