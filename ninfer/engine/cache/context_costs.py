"""ContextCosts: the coefficients the cache planner weighs its choices with.

Two rates: seconds to prefill one token (what recomputing a dropped checkpoint's tokens costs)
and bytes per second between pinned host memory and the device (what restoring a spilled
StateImage costs). They resolve once at start-up, in this order: generic defaults for the
device type; compiled defaults measured on the model shapes we publish figures for; then a
`--context-cost-presets FILE` (JSON) that may set either rate. The chosen source is logged.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer.context_cost_presets import read_presets
from ninfer.models.config import ModelConfig


@dataclass(frozen=True)
class ContextCosts:
    prefill_seconds_per_token: float
    host_transfer_bytes_per_second: float
    source: str

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_seconds_per_token

    def transfer_seconds(self, num_bytes: int) -> float:
        return num_bytes / self.host_transfer_bytes_per_second


# Generic defaults by device type: a large model's prefill on one GPU, pinned PCIe copies; a
# small model on a few CPU cores, memcpy.
_GENERIC = {
    "cuda": (1.0 / 8000.0, 20e9),
    "cpu": (1.0 / 300.0, 5e9),
}

# Measured on an H200 with ninfer bench (bf16 prefill at 64K tokens; pinned copies), keyed by
# (model_type, hidden_size, num_hidden_layers).
_COMPILED = {
    ("qwen3_5_text", 5120, 64): (1.0 / 8200.0, 25e9),  # Qwen3.5/3.6/3.8-27B
    ("qwen3_5_moe_text", 2048, 40): (1.0 / 52000.0, 25e9),  # Qwen3.5/3.6-35B-A3B
}


def generic_costs(device_type: str = "cpu") -> ContextCosts:
    prefill, transfer = _GENERIC.get(device_type, _GENERIC["cuda"])
    return ContextCosts(prefill, transfer, f"generic {device_type} defaults")


def resolve_context_costs(config: ModelConfig, device_type: str, presets_path: str | None = None) -> ContextCosts:
    generic = generic_costs(device_type)
    prefill, transfer, source = generic.prefill_seconds_per_token, generic.host_transfer_bytes_per_second, generic.source
    compiled = _COMPILED.get((config.model_type, config.hidden_size, config.num_hidden_layers))
    if compiled is not None and device_type == "cuda":
        prefill, transfer = compiled
        source = f"compiled defaults for {config.model_type} {config.hidden_size}x{config.num_hidden_layers}"
    if presets_path is not None:
        values = read_presets(presets_path)
        prefill = values.get("prefill_seconds_per_token", prefill)
        transfer = values.get("host_transfer_bytes_per_second", transfer)
        source = f"{presets_path} (over {source})"
    return ContextCosts(prefill, transfer, source)
