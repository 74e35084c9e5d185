"""The on-disk layouts of the quantized checkpoints users download, written from bf16 weights.

Both layouts quantize every projection of the text model (2-D tensors named "proj", not the
vision tower's) and keep every other tensor as it is:
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

from ninfer.kernels.gemv.ref import SCALE_BLOCK, quantize_blocks
from ninfer.kernels.nvfp4_gemv.ref import E2M1_MAX, E4M3_MAX, quantize_nvfp4

STORED_FORMATS = ("bf16", "fp8", "nvfp4")
QUANTIZATION_CONFIGS = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [SCALE_BLOCK, SCALE_BLOCK]},
    "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"]},
}
HF_QUANT_CONFIG_NVFP4 = {
    "producer": {"name": "modelopt"},
    "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]},
}


def is_quantized_in_checkpoint(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and "proj" in name and "visual" not in name


def qwen_fp8_tensors(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A weight [N, K] as Qwen's FP8 checkpoints store it: e4m3 values and one fp32 inverse
    scale per 128x128 block."""
    values, scale_inv = quantize_blocks(weight, SCALE_BLOCK)
    return {name: values, name + "_scale_inv": scale_inv}


def modelopt_nvfp4_tensors(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A weight [N, K] as ModelOpt's NVFP4 checkpoints store it: packed e2m1 codes, e4m3 scales
    per 16 values, one fp32 global scale for the tensor and a unit input scale."""
    global_scale = (weight.float().abs().amax() / (E2M1_MAX * E4M3_MAX)).reshape(())
    codes, block_scale, _ = quantize_nvfp4(weight, global_scale.expand(weight.shape[0]))
    return {
        name: codes,
        name + "_scale": block_scale,
        name + "_scale_2": global_scale.clone(),
        name.removesuffix("weight") + "input_scale": torch.ones((), device=weight.device),
    }


def stored_tensors(weights: str, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors a `weights`-format checkpoint stores for the model tensor `name`."""
    if weights == "bf16" or not is_quantized_in_checkpoint(name, tensor):
        return {name: tensor}
    if weights == "fp8":
        return qwen_fp8_tensors(name, tensor)
    if weights == "nvfp4":
        return modelopt_nvfp4_tensors(name, tensor)
    raise ValueError(f"unknown stored weight format {weights!r}; expected one of {', '.join(STORED_FORMATS)}")


def describe_quantization(weights: str, config: dict, directory: Path) -> dict:
    """config.json's dict with the `weights` format's quantization_config; for NVFP4 also writes
    hf_quant_config.json into directory, as ModelOpt exports do."""
    if weights == "bf16":
        return config
    if weights == "nvfp4":
        (directory / "hf_quant_config.json").write_text(json.dumps(HF_QUANT_CONFIG_NVFP4, indent=2) + "\n")
    return {**config, "quantization_config": QUANTIZATION_CONFIGS[weights]}
