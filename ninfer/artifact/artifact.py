"""Artifact: one opened model (HF directory, GGUF file or .ninfer container) with everything the server needs.

Opening reads only metadata (config, tokenizer, template, tensor headers) and checks
that the tensors fill the model exactly, so a broken artifact fails at open naming the
file; weights are read lazily, one tensor at a time, when the model is loaded. Opened
without weights (the API process: identity, tokenizer, template), no tensor is looked at
and torch is never imported; the engine process's own open checks the tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ninfer.frontend.tokenizer import Tokenizer
from ninfer.models.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from ninfer.models.causal_lm import CausalLM
    from ninfer.parallel.shard_plan import ShardPlan

HF_DIRECTORY = "hf_directory"
GGUF = "gguf"
NINFER = "ninfer"  # a .ninfer container (ninfer_file.py)

# Manifest beside config.json (HF directory) or `<file>.ninfer.json` beside a GGUF file.
MANIFEST_NAME = "ninfer.json"


class ArtifactError(ValueError):
    """The artifact is malformed or unsupported; the message names the file and the problem."""


@dataclass
class Artifact:
    path: Path
    kind: str  # HF_DIRECTORY or GGUF
    model_id: str
    hf_config: dict[str, Any]  # config.json, or the HF-style config rebuilt from GGUF metadata
    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: str | None  # the artifact's own template, byte for byte
    generation_defaults: dict[str, Any]
    num_tensors: int  # how many (name, tensor) pairs weights() yields
    read_weights: Callable[..., Iterator[tuple[str, torch.Tensor]]] = field(repr=False)  # without_weights: raises
    # Block-scaled FP8 weights (name -> shape) a model can keep in FP8; empty for other checkpoints.
    fp8_weights: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)
    # NVFP4 weights (name -> unpacked shape) a model can keep in NVFP4; empty for other checkpoints.
    nvfp4_weights: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)
    # A container in runtime layout builds its model itself: (config, dtype, device, progress, quantize) -> model.
    runtime_loader: Callable[..., CausalLM] | None = field(default=None, repr=False)
    # A container's optional part ("vision/", "dflash/", ...): its tensors, prefix removed.
    read_part: Callable[[str], Iterator[tuple[str, torch.Tensor]]] | None = field(default=None, repr=False)
    # read_weights takes device=: a GPU load's tensors are read straight onto the device.
    reads_to_device: bool = field(default=False, repr=False)
    manifest: dict[str, Any] = field(default_factory=dict, repr=False)  # a container's manifest.json
    resources: dict[str, str] = field(default_factory=dict, repr=False)  # a container's named resources

    def weights(
        self, keep_fp8: bool = False, keep_nvfp4: bool = False, device: torch.device | str | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Lazily read (name, tensor) pairs in HF checkpoint naming (block-scaled FP8 weights
        dequantized to bf16, or with keep_fp8 as stored, each after its `_scale_inv` scales;
        NVFP4 weights likewise with keep_nvfp4, after `_scale` and `_scale_2`).
        device: a CUDA device the tensors may arrive on already (where the artifact reads onto
        devices: reads_to_device); otherwise they come on the CPU."""
        options = {"keep_nvfp4": True} if keep_nvfp4 else {}
        if device is not None and self.reads_to_device and str(device).startswith("cuda"):
            options["device"] = device
        return self.read_weights(keep_fp8, **options) if keep_fp8 or options else self.read_weights()

    def load_model(
        self,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        progress: bool = True,
        keep_fp8: bool | None = None,
        keep_nvfp4: bool | None = None,
        quantize: str | None = None,
        shard: ShardPlan | None = None,
    ) -> CausalLM:
        """keep_fp8 (default: on CUDA devices): FP8 checkpoint weights stay FP8 in Fp8Linear
        layers (GEMV / tensor-core paths); otherwise they are dequantized to bf16 at load.
        keep_nvfp4 (default: on CUDA devices): likewise NVFP4 checkpoint weights in Nvfp4Linear.
        quantize: "fp8" | "nvfp4": the other Linear layers (fp8: and routed experts) quantized
        as their weights arrive, as quantize_fp8_ / quantize_nvfp4_ would quantize them loaded.
        A .ninfer container loads as it was packed (its FP8 layers stay FP8; keep_fp8 is moot), and
        quantize quantizes the layers it holds unquantized, likewise as they arrive.
        shard: load one tensor-parallel rank's part (parallel/shard_plan.py)."""
        import torch

        from ninfer.models.loader import load_model

        if self.runtime_loader is not None:
            return self.runtime_loader(self.config, dtype, device, progress, quantize, shard)
        if keep_fp8 is None:
            keep_fp8 = torch.device(device).type == "cuda"
        if keep_nvfp4 is None:
            keep_nvfp4 = torch.device(device).type == "cuda"
        fp8_weights = self.fp8_weights if keep_fp8 else {}
        nvfp4_weights = self.nvfp4_weights if keep_nvfp4 else {}
        return load_model(
            self.config,
            # Quantizing at load keeps the unquantized tensors off the device: its load peak is
            # the quantized model plus one chunk of rows (models/quant/row_chunks.py).
            self.weights(keep_fp8=bool(fp8_weights), keep_nvfp4=bool(nvfp4_weights),
                         device=device if quantize is None else None),
            dtype=dtype,
            device=device,
            total=self.num_tensors + len(fp8_weights) + 2 * len(nvfp4_weights),
            progress=progress,
            source=str(self.path),
            fp8_weights=fp8_weights,
            nvfp4_weights=nvfp4_weights,
            quantize=quantize,
            shard=shard,
        )


def read_json(path: Path) -> Any:
    try:
        return read_json_text(path.read_bytes().decode("utf-8"), str(path))
    except OSError as error:
        raise ArtifactError(f"{path}: cannot read ({error.strerror or error})") from error
    except UnicodeDecodeError as error:
        raise ArtifactError(f"{path}: invalid JSON ({error})") from error


def read_json_text(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ArtifactError(f"{source}: invalid JSON ({error})") from error


def read_model_id(manifest: Path, default: str) -> str:
    """The manifest's model_id when the manifest exists, else `default`."""
    if not manifest.is_file():
        return default
    data = read_json(manifest)
    model_id = data.get("model_id") if isinstance(data, dict) else None
    if not isinstance(model_id, str) or not model_id.strip():
        raise ArtifactError(f'{manifest}: needs a non-empty string "model_id"')
    return model_id


def check_weights(config: ModelConfig, shapes: Iterable[tuple[str, tuple[int, ...]]], source: str) -> None:
    """Dry-run the load on the meta device: every parameter filled exactly once, shapes agree.

    No tensor data is read; this catches missing, unknown and mis-shaped tensors at open.
    """
    # Imported here, as in load_model: a metadata-only open never needs torch.
    import torch

    from ninfer.models.loader import WeightLoadError, load_model

    tensors = ((name, torch.empty(shape, device="meta")) for name, shape in shapes)
    try:
        load_model(config, tensors, dtype=torch.float32, device="meta", progress=False, source=source)
    except WeightLoadError as error:
        raise ArtifactError(str(error)) from error


def without_weights(path: Path) -> Callable[..., Iterator[tuple[str, torch.Tensor]]]:
    """read_weights of an artifact opened for its metadata only."""

    def read(*_: object, **__: object) -> Iterator[tuple[str, torch.Tensor]]:
        raise ArtifactError(f"{path}: opened without its weights (metadata only)")

    return read
