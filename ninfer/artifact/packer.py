"""`ninfer pack SRC OUT`: write any artifact as one .ninfer container (see ninfer_file.py).

The source model is loaded on the CPU as the server would build it: projections packed,
and with --weights fp8 (nvfp4) the checkpoint's FP8 (NVFP4) weights kept as stored and
every other Linear layer quantized as its weights are read (FP8: per output channel;
NVFP4: e4m3 scales per 16 values and an fp32 scale per row). Its runtime tensors, the tokenizer, the chat template
byte for byte, generation defaults, the vision tower and any DFlash / DFlash2 companion
of the source go into the container. Packing holds the model's weights in host memory once
(a 27B model in FP8: ~28 GB; in bf16: ~54 GB), never its bf16 weights beside their
quantized ones, and streams them to the file.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from tqdm import tqdm

from ninfer.artifact.artifact import ArtifactError
from ninfer.artifact.draft_companion import companion_locations, open_draft_companion
from ninfer.artifact.hf_directory import fp8_block_size
from ninfer.artifact.ninfer_file import (
    CONFIG_KEY,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_KEY,
    TEMPLATE_KEY,
    TOKENIZER_CONFIG_KEY,
    TOKENIZER_KEY,
    VISION_PREFIX,
    open_ninfer_file,
)
from ninfer.artifact.safetensors_weights import SafetensorsWeights
from ninfer.artifact.safetensors_writer import write_safetensors
from ninfer.models.runtime_layout import quantized_modules, runtime_tensors

log = logging.getLogger("ninfer.pack")

WEIGHT_FORMATS = ("bf16", "fp8", "nvfp4")


@dataclass(frozen=True)
class PackReport:
    path: Path
    model_id: str
    weights: str
    num_tensors: int
    num_bytes: int
    quantized_modules: int
    parts: tuple[str, ...]
    seconds: float


def pack(
    source: str | Path,
    out: str | Path,
    weights: str = "bf16",
    model_id: str | None = None,
    progress: bool = True,
) -> PackReport:
    """Pack the artifact at `source` into the container `out` (written atomically)."""
    from ninfer.artifact import open_artifact

    if weights not in WEIGHT_FORMATS:
        raise ArtifactError(f"--weights must be one of {', '.join(WEIGHT_FORMATS)}, not {weights!r}")
    if model_id is not None and not model_id.strip():
        raise ArtifactError("--model-id must not be empty")
    started = time.perf_counter()
    out = Path(out)
    if not out.parent.is_dir():
        raise ArtifactError(f"{out.parent}: no such directory")
    artifact = open_artifact(source)
    log.info("packing %s (%s) as %s weights", artifact.path, artifact.kind, weights)
    model = artifact.load_model(
        dtype=torch.bfloat16,
        device="cpu",
        progress=progress,
        keep_fp8=weights == "fp8",
        keep_nvfp4=weights == "nvfp4",
        quantize=None if weights == "bf16" else weights,
    )
    tensors = runtime_tensors(model)
    parts: list[str] = []
    vision = _vision_tensors(artifact)
    if vision:
        tensors.update({VISION_PREFIX + name: tensor for name, tensor in vision.items()})
        parts.append("vision")
    resources: dict[str, str] = {}
    for kind, companion_tensors, companion_config in _companions(artifact):
        tensors.update({f"{kind}/{name}": tensor for name, tensor in companion_tensors.items()})
        resources[f"{kind}/config.json"] = companion_config
        parts.append(kind)
    if artifact.config.mtp_num_hidden_layers:
        parts.append("mtp")

    modules = quantized_modules(model)
    manifest = {
        "format_version": FORMAT_VERSION,
        "identity": {"model_id": model_id or artifact.model_id},
        "weights": {"format": weights, "modules": modules},
        "parts": sorted(parts),
        "generation_defaults": artifact.generation_defaults,
        "source": {"kind": artifact.kind, "name": artifact.path.name},
        "packed_by": f"ninfer {_ninfer_version()}",
    }
    metadata = {
        "format": FORMAT_NAME,
        MANIFEST_KEY: json.dumps(manifest),
        CONFIG_KEY: json.dumps(_runtime_config(artifact.hf_config)),
        TOKENIZER_KEY: artifact.tokenizer.to_json(),
        TOKENIZER_CONFIG_KEY: artifact.tokenizer.dump_config(),
        **resources,
    }
    if artifact.chat_template is not None:
        metadata[TEMPLATE_KEY] = artifact.chat_template
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    with tqdm(total=num_bytes, desc="writing", unit="B", unit_scale=True, disable=not progress, leave=False) as bar:
        write_safetensors(out, tensors, metadata, on_bytes=bar.update)
    open_ninfer_file(out)  # what was written opens: every tensor present with its shape
    return PackReport(
        path=out,
        model_id=manifest["identity"]["model_id"],
        weights=weights,
        num_tensors=len(tensors),
        num_bytes=num_bytes,
        quantized_modules=len(modules),
        parts=tuple(sorted(parts)),
        seconds=time.perf_counter() - started,
    )


def _runtime_config(hf_config: dict) -> dict:
    """config.json without its quantization_config: the container's manifest says how its
    tensors are stored, and a checkpoint's quantization no longer applies to them."""
    config = {key: value for key, value in hf_config.items() if key != "quantization_config"}
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = {k: v for k, v in config["text_config"].items() if k != "quantization_config"}
    return config


def _vision_tensors(artifact) -> dict[str, torch.Tensor]:
    """The vision tower's checkpoint tensors (bf16, FP8 dequantized), when the artifact has one."""
    from ninfer.models.vision_loader import is_vision_tensor

    if not artifact.hf_config.get("vision_config"):
        return {}
    if artifact.read_part is not None:
        return dict(artifact.read_part(VISION_PREFIX))
    if not artifact.path.is_dir():
        return {}
    weights = SafetensorsWeights(artifact.path, fp8_block_size(artifact.hf_config))
    return {name: tensor.to(torch.bfloat16) for name, tensor in weights.read(only=is_vision_tensor)}


def _companions(artifact):
    """(kind, tensors, config.json text) of every DFlash / DFlash2 companion of the source."""
    for kind in ("dflash", "dflash2"):
        if artifact.read_part is not None:
            config = artifact.resources.get(f"{kind}/config.json")
            if config is not None:
                yield kind, dict(artifact.read_part(f"{kind}/")), config
            continue
        if not any((d / "config.json").is_file() for d in companion_locations(artifact.path, kind)):
            continue
        companion = open_draft_companion(artifact.path, kind)
        companion.check_weights()
        config_text = (companion.path / "config.json").read_bytes().decode("utf-8")
        yield kind, dict(companion.weights.read()), config_text


def _ninfer_version() -> str:
    try:
        return version("ninfer")
    except PackageNotFoundError:
        return "unknown"
