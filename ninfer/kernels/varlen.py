"""Start offsets of requests packed one after another (varlen kernels' cu_seqlens).

Built once per distinct tuple of request lengths and device, then shared by every layer of
a step (and by later steps with the same lengths): a fresh tensor per layer meant a host
-> device copy per layer from pageable memory, which the driver stages synchronously.
Callers must not write the returned tensor.
"""

from __future__ import annotations

import functools
import itertools

import torch


@functools.lru_cache(maxsize=64)
def start_offsets(lengths: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[len(lengths) + 1] offsets 0, l0, l0 + l1, ... on `device` (copied from pinned memory on CUDA)."""
    host = torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
