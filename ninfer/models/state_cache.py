"""StateCache: per-slot continuation state of every Gated DeltaNet layer.

A slot holds one sequence's conv state (the last kernel-1 pre-conv inputs) and its
fp32 recurrent state for every linear-attention layer: together a StateImage.
Slots are assigned, snapshotted and restored by the engine's state pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StateCache:
    conv: torch.Tensor  # [num_layers, num_slots, conv_dim, kernel - 1] model dtype
    recurrent: torch.Tensor  # [num_layers, num_slots, num_v_heads, k_head_dim, v_head_dim] float32

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_slots: int,
        conv_dim: int,
        conv_kernel: int,
        num_v_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> StateCache:
        conv = torch.zeros((num_layers, num_slots, conv_dim, conv_kernel - 1), dtype=dtype, device=device)
        recurrent = torch.zeros(
            (num_layers, num_slots, num_v_heads, k_head_dim, v_head_dim), dtype=torch.float32, device=device
        )
        return cls(conv, recurrent)

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    def layer(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[layer_index], self.recurrent[layer_index]

    def reset(self, slot: int) -> None:
        """Zero a slot so a new sequence starts from the empty state."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        """Snapshot/restore: copy one complete StateImage between slots."""
        self.conv[:, dst].copy_(self.conv[:, src])
        self.recurrent[:, dst].copy_(self.recurrent[:, src])

    def copy_layer_slots(self, layer_index: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """One layer's state of slots src[i] into dst[i] (device index tensors: no host sync)."""
        conv, recurrent = self.layer(layer_index)
        conv.index_copy_(0, dst, conv.index_select(0, src))
        recurrent.index_copy_(0, dst, recurrent.index_select(0, src))

    @property
    def bytes_per_slot(self) -> int:
        conv = self.conv[:, 0].numel() * self.conv.element_size()
        rec = self.recurrent[:, 0].numel() * self.recurrent.element_size()
        return conv + rec
