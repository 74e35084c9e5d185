"""A tiny MoE checkpoint in Qwen's FP8 layout with FP8 experts, for tests of loading and packing them.

stored_formats quantizes 2-D projections only: the per-expert MTP experts, not the fused 3-D
trunk experts (the hub trunk layout). Here the fused ones are block-quantized too, as Qwen
stores them (`<name>_scale_inv` [E, ceil(N/128), ceil(K/128)]), and every expert is re-drawn
at intermediate size `inter`: a multiple of 128 lines the per-expert gate and up up with
128-row blocks, 32 (the tiny model's) does not.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ninfer.models.quant.fp8 import SCALE_BLOCK, quantize_blocks
from ninfer.models.quant.stored_formats import describe_quantization, stored_tensors
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5

_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def fp8_moe_checkpoint(root: Path, inter: int) -> Path:
    """The tiny MoE + MTP artifact under `root`, experts re-drawn at `inter` and every projection FP8."""
    out = root / f"tiny-moe-fp8-experts-i{inter}"
    if out.exists():
        return out
    source = make_tiny_qwen3_5(root, moe=True, mtp=True)
    out.mkdir()
    for item in source.iterdir():
        if item.is_file() and item.name not in ("model.safetensors", "config.json"):
            (out / item.name).write_bytes(item.read_bytes())
    config = json.loads((source / "config.json").read_text())
    text = config.get("text_config", config)
    text["moe_intermediate_size"] = inter
    gen = torch.Generator().manual_seed(inter)
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        shape = _expert_shape(name, tensor.shape, inter)
        if shape is not None:
            tensor = (torch.randn(shape, generator=gen) * shape[-1] ** -0.5).to(tensor.dtype)
        if tensor.dim() == 3:
            values, scale_inv = quantize_blocks(tensor, SCALE_BLOCK)
            stored.update({name: values, name + "_scale_inv": scale_inv})
        else:
            stored.update(stored_tensors("fp8", name, tensor))
    save_file(stored, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(describe_quantization("fp8", config, out)))
    return out


def _expert_shape(name: str, shape: torch.Size, inter: int) -> tuple[int, ...] | None:
    """An expert tensor's shape at intermediate size `inter`; None for other tensors."""
    fused, per_expert = _FUSED.search(name), _PER_EXPERT.search(name)
    if fused is not None:
        return (shape[0], 2 * inter, shape[2]) if fused[1] == "gate_up_proj" else (shape[0], shape[1], inter)
    if per_expert is not None:
        return (shape[0], inter) if per_expert[1] == "down" else (inter, shape[1])
    return None
