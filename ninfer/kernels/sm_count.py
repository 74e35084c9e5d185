"""How many SMs a kernel's grid should fill: launch heuristics size their grids by it."""

from __future__ import annotations

import functools

import torch

INTERPRETER_SMS = 132  # CPU interpreter runs pretend an H200, so they take the GPU's configs


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """The SM count of a CUDA device (INTERPRETER_SMS for a CPU tensor's device)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
