"""A tiny artifact re-stored in a quantized checkpoint layout, for tests of quantized loading.

Both copies quantize every projection of the text model (names with "proj", not the vision
tower's), keep everything else as stored, and copy the tokenizer, template and configs:
- Qwen's FP8: e4m3 weights with one inverse scale per 128x128 block (`<name>_scale_inv`) and
  `quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`;
- NVIDIA ModelOpt's NVFP4: uint8 e2m1 codes, e4m3 `<name>_scale` per 16 values, fp32
  `<name>_scale_2` per tensor and `<name>.input_scale`, with `hf_quant_config.json` and
  `quantization_config: {quant_method: modelopt, quant_algo: NVFP4, group_size: 16}`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ninfer.kernels.nvfp4_gemv.ref import E2M1_MAX, E4M3_MAX, quantize_nvfp4


def _quantized(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and "proj" in name and "visual" not in name


def _copy_with(source: Path, out: Path, tensors: dict[str, torch.Tensor], quantization: dict) -> Path:
    out.mkdir(parents=True)
    for item in source.iterdir():
        if item.name != "model.safetensors" and item.is_file():
            (out / item.name).write_bytes(item.read_bytes())
    save_file(tensors, out / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config))
    return out


def qwen_fp8_copy(source: Path, out: Path) -> Path:
    stored = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if not _quantized(name, tensor):
            stored[name] = tensor
            continue
        rows, cols = tensor.shape
        blocks = torch.nn.functional.pad(tensor.float(), (0, -cols % 128, 0, -rows % 128))
        blocks = blocks.view(-(-rows // 128), 128, -(-cols // 128), 128)
        scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
        expanded = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
        stored[name] = (tensor.float() / expanded).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        stored[name + "_scale_inv"] = scale_inv
    return _copy_with(source, out, stored, {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})


def modelopt_nvfp4_copy(source: Path, out: Path) -> Path:
    stored = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if not _quantized(name, tensor):
            stored[name] = tensor
            continue
        global_scale = (tensor.float().abs().amax() / (E2M1_MAX * E4M3_MAX)).reshape(())
        codes, block_scale, _ = quantize_nvfp4(tensor, global_scale.expand(tensor.shape[0]))
        stored[name] = codes
        stored[name + "_scale"] = block_scale
        stored[name + "_scale_2"] = global_scale.clone()
        stored[name.removesuffix("weight") + "input_scale"] = torch.ones(())
    quantization = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"]}
    out = _copy_with(source, out, stored, quantization)
    hf_quant = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                                   "exclude_modules": ["lm_head"]}}
    (out / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return out
