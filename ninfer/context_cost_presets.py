"""--context-cost-presets FILE: the cache planner's rates a JSON file sets, checked when options are read.

Outside the engine package: the API process validates the file at start-up (a malformed one
stops it naming the problem) without importing the engine; engine/context_costs.py applies it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

_PRESET_KEYS = {"prefill_seconds_per_token", "host_transfer_bytes_per_second"}


class ContextCostError(ValueError):
    """A presets file that cannot be used; the message names the file and the problem."""


def read_presets(path: str) -> dict[str, float]:
    """The rates a presets file sets; a malformed file raises ContextCostError naming the problem."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise ContextCostError(f"--context-cost-presets {path}: cannot read it ({error.strerror})") from error
    except json.JSONDecodeError as error:
        raise ContextCostError(f"--context-cost-presets {path}: not JSON ({error.msg} at line {error.lineno})") from error
    if not isinstance(data, dict):
        raise ContextCostError(f"--context-cost-presets {path}: expected a JSON object")
    unknown = sorted(set(data) - _PRESET_KEYS)
    if unknown:
        raise ContextCostError(
            f"--context-cost-presets {path}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_PRESET_KEYS))})"
        )
    values = {}
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ContextCostError(f"--context-cost-presets {path}: {key} must be a positive number, got {value!r}")
        values[key] = float(value)
    return values
