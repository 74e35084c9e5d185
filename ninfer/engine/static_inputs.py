"""StaticInputs: named device tensors at fixed addresses in one buffer, which a CUDA graph
captures, filled from pinned host mirrors used in turn (verify_graphs.py, verify_penalties.py)."""

from __future__ import annotations

from math import prod

import numpy as np
import torch

_ALIGN = 16
# Pinned mirrors used in turn: a round may be launched while the previous one's copy is queued.
_NUM_STAGING = 2
_NP_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}


class StaticInputs:
    """Named device tensors at fixed addresses in one buffer (what a graph captures), filled
    from a pinned host mirror by one non-blocking copy."""

    def __init__(self, fields: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        layout, total = {}, 0
        for name, (shape, dtype) in fields.items():
            nbytes = prod(shape) * torch.empty(0, dtype=dtype).element_size()
            layout[name] = (total, nbytes, shape, dtype)
            total = -(-(total + nbytes) // _ALIGN) * _ALIGN
        pin = device.type == "cuda"
        self._device = torch.zeros(total, dtype=torch.uint8, device=device)
        self._host = [torch.zeros(total, dtype=torch.uint8, pin_memory=pin) for _ in range(_NUM_STAGING)]
        self._copied = [torch.cuda.Event() for _ in range(_NUM_STAGING)] if pin else None
        self.views = {
            name: self._device[start : start + nbytes].view(dtype).view(shape)
            for name, (start, nbytes, shape, dtype) in layout.items()
        }
        self._host_views = [
            {
                name: host.numpy()[start : start + nbytes].view(_NP_DTYPES[dtype]).reshape(shape)
                for name, (start, nbytes, shape, dtype) in layout.items()
            }
            for host in self._host
        ]
        self._turn = 0

    def next_mirror(self) -> dict[str, np.ndarray]:
        """The next pinned mirror to fill (its previous copy to the device has completed)."""
        self._turn = (self._turn + 1) % _NUM_STAGING
        if self._copied is not None:
            self._copied[self._turn].synchronize()
        return self._host_views[self._turn]

    def upload(self, num_bytes: int | None = None) -> None:
        """Copy the mirror last returned by next_mirror() into the device tensors (queued);
        num_bytes: only the buffer's first bytes (what a round filled of a large field)."""
        end = self._device.numel() if num_bytes is None else min(-(-num_bytes // _ALIGN) * _ALIGN, self._device.numel())
        self._device[:end].copy_(self._host[self._turn][:end], non_blocking=True)
        if self._copied is not None:
            self._copied[self._turn].record()

    def copy_to_mirrors(self) -> None:
        """Make every mirror hold the device tensors' values (start-up defaults set on the device)."""
        for host in self._host:
            host.copy_(self._device)
