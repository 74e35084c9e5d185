"""A random-weight checkpoint in the real on-disk layout, for end-to-end figures without the weights.

`ninfer bench write-checkpoint --shape 27b DIR` writes what a Hugging Face model directory
holds (config.json, safetensors shards with their index, the Qwen3.5 tokenizer and chat
template) with the deterministic random weights of random_weights.py, so `ninfer-serve DIR`
loads and serves it exactly as it would the published model: same shapes, same tensor
names, same load path. `--weights fp8|nvfp4` stores them as the published quantized
checkpoints do (Qwen's block-scaled FP8, ModelOpt's NVFP4), quantized from the same bf16
weights. `--vision` adds the VLM's vision tower (`model.visual.*`, `vision_config`), so
`ninfer-serve DIR --vision` serves images and video. `--constant-output` stores the output
norms (the trunk's and the MTP head's) as zero: every position's logits are zero, so greedy
decoding emits token 0 every step and the MTP head drafts it, and speculative rounds accept
every draft with the model's full bytes and work (served figures at full acceptance). Write it
to tmpfs (e.g. /dev/shm) when disk is slow.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from ninfer.assets.qwen_tokenizer import write_qwen3_5_tokenizer
from ninfer.bench.random_weights import fill_random_, stored_parameters
from ninfer.bench.shapes import shape_config, vision_shape_config
from ninfer.models.config import ModelConfig
from ninfer.models.layers.norm import RMSNorm
from ninfer.models.loader import build_model
from ninfer.models.quant.stored_formats import describe_quantization, stored_tensors
from ninfer.models.vision_config import VisionConfig
from ninfer.models.vision_loader import build_vision_tower

log = logging.getLogger("ninfer.bench")

ARCHITECTURES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
OUTPUT_NORMS = ("model.norm.weight", "mtp.norm.weight")  # the norms before the (shared) lm_head
SHARD_BYTES = 4 << 30  # the hub's shards are a few GB each


def write_random_checkpoint(
    shape: str, directory: str | Path, *, seed: int = 0, device: str = "cuda", shard_bytes: int = SHARD_BYTES,
    mtp: bool = False, weights: str = "bf16", vision: bool = False, num_layers: int | None = None,
    constant_output: bool = False,
) -> Path:
    """Build `shape` with random bf16 weights on `device` and write it under `directory`; mtp:
    with the published checkpoints' one-layer MTP head; weights: the stored format (bf16, fp8,
    nvfp4), each shard quantized on `device` as it is written; vision: with the VLM's vision tower
    (kept in bf16, as the published quantized checkpoints keep it); num_layers: only the first
    layers (every tensor at the real shape, in a fraction of the bytes); constant_output: the
    output norms zero (module docstring)."""
    from safetensors.torch import save_file

    hf_config, config = shape_config(shape)
    if num_layers is not None:
        hf_config = {**hf_config, "num_hidden_layers": num_layers}
        config = ModelConfig.from_hf(hf_config, source=f"bench shape {shape}, {num_layers} layers")
    if mtp:
        hf_config = {**hf_config, "mtp_num_hidden_layers": 1}
        config = config.replace(mtp_num_hidden_layers=1)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = build_model(config, torch.bfloat16, device)
    fill_random_(stored_parameters(model), seed)
    tensors = list(stored_parameters(model))
    if constant_output:
        zero_output_norms_(model, tensors)
    if vision:
        hf_config = {**hf_config, "vision_config": vision_shape_config(shape)}
        tower = build_vision_tower(VisionConfig.from_hf(hf_config), torch.bfloat16, device)
        tower_tensors = [("model.visual." + name, param) for name, param in tower.named_parameters()]
        fill_random_(tower_tensors, seed)
        tensors += tower_tensors
    total_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
    log.info("%s: %d tensors, %.1f GB of random weights built in %.1fs", shape, len(tensors), total_bytes / 1e9,
             time.perf_counter() - started)
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    shard_size = 0
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_size + size > shard_bytes:
            shards.append([])
            shard_size = 0
        shards[-1].append((name, tensor))
        shard_size += size
    weight_map: dict[str, str] = {}
    written = 0
    stored_bytes = 0
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        stored: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, tensor in shard:
                stored.update({key: value.to("cpu").contiguous() for key, value in stored_tensors(weights, name, tensor).items()})
        save_file(stored, out / file_name, metadata={"format": "pt"})
        weight_map.update({name: file_name for name in stored})
        written += sum(t.numel() * t.element_size() for _, t in shard)
        stored_bytes += sum(t.numel() * t.element_size() for t in stored.values())
        log.info("wrote %s (%.1f / %.1f GB of bf16 weights)", file_name, written / 1e9, total_bytes / 1e9)
    index = {"metadata": {"total_size": stored_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    hf = {**hf_config, "architectures": [ARCHITECTURES[hf_config["model_type"]]], "torch_dtype": "bfloat16"}
    hf = describe_quantization(weights, hf, out)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    write_qwen3_5_tokenizer(out)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    log.info("%s: random-weight %s checkpoint in %s (%.1f GB, %.1fs)", shape, weights, out, stored_bytes / 1e9,
             time.perf_counter() - started)
    return out


@torch.no_grad()
def zero_output_norms_(model: torch.nn.Module, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Make the norms before the lm_head output zero: weight -1 in the (1 + w) form, else 0."""
    norms = {id(module.weight): module for module in model.modules() if isinstance(module, RMSNorm)}
    found = [(name, tensor) for name, tensor in tensors if name in OUTPUT_NORMS]
    if OUTPUT_NORMS[0] not in dict(found):
        raise ValueError(f"constant output: no {OUTPUT_NORMS[0]} in this model")
    for _, tensor in found:
        tensor.fill_(-1.0 if norms[id(tensor)].zero_centered else 0.0)
