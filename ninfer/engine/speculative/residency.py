"""Speculative residency: which backend an artifact can serve, decided once at start-up.

--spec freezes the backend for the process's life. A combination the artifact cannot serve
fails start-up naming the missing part, before any weight is loaded.
"""

from __future__ import annotations

from ninfer.config import ConfigValueError, EngineConfig


def check_speculative(artifact, engine: EngineConfig) -> None:
    """Raise ConfigValueError when `artifact` cannot serve engine.spec."""
    if engine.spec is None:
        return
    where = str(artifact.path)
    if engine.spec == "mtp":
        if not artifact.config.mtp_num_hidden_layers:
            raise ConfigValueError(
                f"--spec mtp: {where} has no MTP head (no mtp.* tensors, or a model type without one); "
                "serve it without --spec"
            )
        return
    raise ConfigValueError(
        f"--spec {engine.spec}: {where} has no {engine.spec.upper()} drafter companion (a directory of its "
        "drafter's config.json and weights inside or beside the artifact)"
    )
