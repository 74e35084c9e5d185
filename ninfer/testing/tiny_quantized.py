"""A tiny artifact re-stored in a quantized checkpoint layout, for tests of quantized loading.

The layouts are those of models/quant/stored_formats.py (Qwen's block-scaled FP8, ModelOpt's
NVFP4); the tokenizer, template and configs are copied beside the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from ninfer.models.quant.stored_formats import describe_quantization, stored_tensors


def _quantized_copy(source: Path, out: Path, weights: str) -> Path:
    out.mkdir(parents=True)
    for item in source.iterdir():
        if item.name != "model.safetensors" and item.is_file():
            (out / item.name).write_bytes(item.read_bytes())
    stored = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        stored.update(stored_tensors(weights, name, tensor))
    save_file(stored, out / "model.safetensors")
    config = describe_quantization(weights, json.loads((source / "config.json").read_text()), out)
    (out / "config.json").write_text(json.dumps(config))
    return out


def qwen_fp8_copy(source: Path, out: Path) -> Path:
    return _quantized_copy(source, out, "fp8")


def modelopt_nvfp4_copy(source: Path, out: Path) -> Path:
    return _quantized_copy(source, out, "nvfp4")
