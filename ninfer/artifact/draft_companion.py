"""DraftCompanion: a DFlash / DFlash2 drafter stored with its target artifact.

For --spec X (dflash or dflash2) the companion is the directory `X/` inside the artifact's
directory, else the directory `<artifact>-X/` beside the artifact (for a GGUF file, named after
the file without its extension: `model-dflash2/` beside `model.gguf`). It holds the drafter's
config.json and its safetensors weights (model.safetensors, or an index and its shards).
A .ninfer container may carry the companion itself (`X/config.json` and `X/` tensors), which
then wins over the directories.

Opening reads the config and the tensor headers; check_weights dry-runs the load on the meta
device, so a broken companion fails at start-up naming the file and the missing part. The
weights are read when the drafter is loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from ninfer.artifact.artifact import ArtifactError, read_json, read_json_text
from ninfer.artifact.safetensors_weights import SafetensorsWeights
from ninfer.models.config import ConfigError
from ninfer.models.dflash import DflashDraftModel
from ninfer.models.draft_config import DraftConfig
from ninfer.models.draft_loader import load_draft_model


def companion_locations(artifact_path: Path, kind: str) -> tuple[Path, Path]:
    """(inside, beside): where a `kind` companion of the artifact at artifact_path may live, in order."""
    name = artifact_path.stem if artifact_path.is_file() else artifact_path.name
    return artifact_path / kind, artifact_path.with_name(f"{name}-{kind}")


class CompanionWeights(Protocol):
    """Stored tensor names and shapes, read lazily (SafetensorsWeights, or a container's part)."""

    names: list[str]
    shapes: dict[str, tuple[int, ...]]

    def read(self) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass
class DraftCompanion:
    path: Path
    config: DraftConfig
    weights: CompanionWeights = field(repr=False)

    @property
    def num_tensors(self) -> int:
        return len(self.weights.names)

    def check_weights(self) -> None:
        """Dry-run the load on the meta device: ArtifactError names a missing, unknown or mis-shaped tensor."""
        shapes = ((name, torch.empty(self.weights.shapes[name], device="meta")) for name in self.weights.names)
        try:
            load_draft_model(self.config, shapes, dtype=torch.float32, device="meta", source=str(self.path))
        except ValueError as error:  # a WeightLoadError, or sizes the modules cannot take
            raise ArtifactError(str(error)) from error

    def load_model(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> DflashDraftModel:
        return load_draft_model(
            self.config, self.weights.read(), dtype=dtype, device=device, total=self.num_tensors, source=str(self.path)
        )


def open_draft_companion(artifact_path: Path, kind: str, artifact=None) -> DraftCompanion:
    """The `kind` companion of the artifact, its config parsed and its tensor headers read;
    ArtifactError says what is missing or wrong. artifact: the opened artifact, whose
    container may carry the companion."""
    resources = getattr(artifact, "resources", {})
    if f"{kind}/config.json" in resources:
        from ninfer.artifact.ninfer_file import container_part

        source = f"{artifact_path}:{kind}/config.json"
        config = _draft_config(read_json_text(resources[f"{kind}/config.json"], source), kind, source)
        return DraftCompanion(Path(f"{artifact_path}:{kind}"), config, container_part(artifact, f"{kind}/"))
    inside, beside = companion_locations(artifact_path, kind)
    directory = next((d for d in (inside, beside) if (d / "config.json").is_file()), None)
    if directory is None:
        raise ArtifactError(
            f"no {kind.upper()} drafter companion: neither {inside} nor {beside} holds a config.json"
        )
    config_path = directory / "config.json"
    config = _draft_config(read_json(config_path), kind, str(config_path))
    return DraftCompanion(directory, config, SafetensorsWeights(directory))


def _draft_config(hf_config: object, kind: str, source: str) -> DraftConfig:
    if not isinstance(hf_config, dict):
        raise ArtifactError(f"{source}: expected a JSON object")
    try:
        return DraftConfig.from_hf(hf_config, kind, source=source)
    except ConfigError as error:
        raise ArtifactError(str(error)) from error
