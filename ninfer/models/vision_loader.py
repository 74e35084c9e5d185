"""Build a Qwen3.5-family vision tower and fill it from a checkpoint's `model.visual.*` tensors.

The text trunk's loader drops these tensors (families/qwen3_5.py); this reads only them, strips
the prefix (`model.visual.` in hub VLM checkpoints, `visual.` in older layouts) and lets the
shared loader check that every tower parameter is written exactly once with its stored shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ninfer.artifact.artifact import HF_DIRECTORY, NINFER, Artifact, ArtifactError
from ninfer.artifact.hf_directory import fp8_block_size
from ninfer.artifact.ninfer_file import VISION_PREFIX
from ninfer.artifact.safetensors_weights import SafetensorsWeights
from ninfer.models.config import ConfigError
from ninfer.models.family import WeightSlice
from ninfer.models.loader import WeightLoadError, load_weights
from ninfer.models.meta_build import meta_build, with_storage
from ninfer.models.vision import VisionTower
from ninfer.models.vision_config import VisionConfig

VISION_PREFIXES = ("model.visual.", "visual.")


def tower_name(stored_name: str) -> str | None:
    """The tower's parameter name for a stored tensor, or None when it is not a vision tensor."""
    for prefix in VISION_PREFIXES:
        if stored_name.startswith(prefix):
            return stored_name.removeprefix(prefix)
    return None


def is_vision_tensor(stored_name: str) -> bool:
    return tower_name(stored_name) is not None


def _vision_rule(name: str, tensor: torch.Tensor, config: VisionConfig) -> Iterator[WeightSlice]:
    target = tower_name(name)
    if target is not None:
        yield target, None, tensor


def build_vision_tower(config: VisionConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> VisionTower:
    """An uninitialised tower with storage on `device` (no weights read)."""
    with meta_build():
        tower = VisionTower(config).to(dtype)
    return with_storage(tower, device)


def load_vision_weights(
    tower: VisionTower, tensors: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
) -> None:
    """Fill `tower` from stored (name, tensor) pairs; non-vision names are skipped.

    WeightLoadError names what is missing, mis-shaped or unknown; a checkpoint holding no vision
    tensors at all gets its own message rather than a list of every tower parameter."""
    seen = 0

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal seen
        for name, tensor in tensors:
            if is_vision_tensor(name):
                seen += 1
                yield name, tensor

    where = f"{source} (vision tower)"
    try:
        load_weights(tower, counted(), progress=False, source=where, rule=_vision_rule)
    except WeightLoadError:
        if seen == 0:
            raise WeightLoadError(
                f"{source}: holds no vision tower tensors ({' or '.join(p + '*' for p in VISION_PREFIXES)}); "
                "the vision tower cannot be loaded from it"
            ) from None
        raise


def load_vision_tower(
    artifact: Artifact, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> VisionTower:
    """The artifact's vision tower, in eval mode, on `device` in `dtype`.

    Reads only the vision tensors (block-scaled FP8 ones dequantized). ArtifactError when the
    artifact has no vision_config or is not an HF directory; WeightLoadError when its
    tensors do not fill the tower (naming what is missing)."""
    source = str(artifact.path)
    if artifact.kind not in (HF_DIRECTORY, NINFER):
        raise ArtifactError(
            f"{source}: a vision tower loads from an HF model directory or a .ninfer container, not a {artifact.kind}"
        )
    try:
        config = VisionConfig.from_hf(artifact.hf_config, source=f"{source}:config.json")
    except ConfigError as error:
        raise ArtifactError(str(error)) from error
    if artifact.read_part is not None:
        tensors = artifact.read_part(VISION_PREFIX)
    else:
        tensors = SafetensorsWeights(artifact.path, fp8_block_size(artifact.hf_config)).read(only=is_vision_tensor)
    tower = build_vision_tower(config, dtype, device)
    load_vision_weights(tower, tensors, source=source)
    return tower.eval()
