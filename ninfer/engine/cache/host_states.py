"""HostStates: the pinned host tier of checkpoint StateImages (SpillSlot / RestoreSlot).

Each host slot holds one StateImage (every Gated DeltaNet layer's conv and fp32 recurrent
state) and the per-slot tensors stored with it (the last position's logits, and with MTP
speculation its hidden state), laid out slot-major so one slot is one contiguous block of
pinned memory per tensor. Copies are issued on the compute stream without a host wait: a
spill is ordered after the work that wrote the device slot and before any later reuse of
it, and a restore before the forward that reads it; the host never reads these buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.models.state_cache import StateCache


class HostStates:
    def __init__(
        self, device_states: StateCache | None, device_logits: torch.Tensor, num_slots: int,
        extra_slot_tensors: Sequence[torch.Tensor] = (),
    ):
        """extra_slot_tensors: more [num_device_slots, ...] tensors that travel with a StateImage."""
        self.num_slots = num_slots
        pin = device_logits.is_cuda
        self.device_states = device_states

        def like(per_slot: torch.Tensor) -> torch.Tensor:
            return torch.zeros((num_slots, *per_slot.shape), dtype=per_slot.dtype, pin_memory=pin)

        self.conv = self.recurrent = None
        if device_states is not None:
            # Device storage is layer-major: [layers, slots, ...]; one slot is [:, slot].
            self.conv = like(device_states.conv[:, 0])
            self.recurrent = like(device_states.recurrent[:, 0])
        # Slot-major device tensors and their host copies (the logits first).
        self._slot_major = [(tensor, like(tensor[0])) for tensor in (device_logits, *extra_slot_tensors)]
        self.logits = self._slot_major[0][1]

    @property
    def bytes_per_slot(self) -> int:
        tensors = [t for t in (self.conv, self.recurrent) if t is not None] + [host for _, host in self._slot_major]
        return sum(t.shape[1:].numel() * t.element_size() for t in tensors)

    def spill(self, device_slot: int, host_slot: int) -> None:
        if self.device_states is not None:
            self.conv[host_slot].copy_(self.device_states.conv[:, device_slot], non_blocking=True)
            self.recurrent[host_slot].copy_(self.device_states.recurrent[:, device_slot], non_blocking=True)
        for device, host in self._slot_major:
            host[host_slot].copy_(device[device_slot], non_blocking=True)

    def restore(self, host_slot: int, device_slot: int) -> None:
        if self.device_states is not None:
            self.device_states.conv[:, device_slot].copy_(self.conv[host_slot], non_blocking=True)
            self.device_states.recurrent[:, device_slot].copy_(self.recurrent[host_slot], non_blocking=True)
        for device, host in self._slot_major:
            device[device_slot].copy_(host[host_slot], non_blocking=True)
