"""NVFP4 routed experts: the fused expert weights of an MoE layer in 4.5 bits a weight.

Decode reads each chosen expert's weights once per step, and the 35B-A3B's experts are most of
its streamed bytes: NVFP4 streams 0.56 bytes a weight where bf16 streams 2. The layout is
ModelOpt's, per expert (kernels/nvfp4_gemv/ref.py): e2m1 codes two a byte, an e4m3 scale per
16 values, an fp32 scale per row (a checkpoint's per-tensor global scale, repeated on each of
its rows, so gate and up keep their own once fused). Weight-only: the kernels widen codes in
registers and keep activations in x's dtype (kernels/moe, kernels/moe_block).
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer.kernels.moe import fused_experts
from ninfer.kernels.nvfp4_gemv import BLOCK, quantize_nvfp4
from ninfer.models.layers.moe import Experts
from ninfer.models.quant.fp8_experts import PROJECTIONS
from ninfer.models.quant.row_chunks import quantize_rows_into
from ninfer.models.quant.stored_write import StoredWrite


class Nvfp4Experts(nn.Module):
    stored_weights = PROJECTIONS  # StoresCheckpointWrites

    def __init__(self, gate_up: tuple[torch.Tensor, ...], down: tuple[torch.Tensor, ...]):
        """gate_up, down: (codes uint8 [E, N, K/2], block_scale float8_e4m3fn [E, N, K/16],
        row_scale float32 [E, N]) of gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
        super().__init__()
        for name, (codes, block_scale, row_scale) in zip(PROJECTIONS, (gate_up, down)):
            self.register_buffer(name, codes)
            self.register_buffer(name + "_block_scale", block_scale)
            self.register_buffer(name + "_row_scale", row_scale)

    @classmethod
    def placeholder(cls, experts: Experts) -> Nvfp4Experts:
        """An unfilled module shaped like `experts` (on its device, e.g. meta), for a loader to fill."""
        projections = []
        for name in PROJECTIONS:
            num_experts, rows, cols = getattr(experts, name).shape
            if cols % BLOCK:
                raise ValueError(f"NVFP4 experts need a multiple of {BLOCK} input features, not {cols} ({name})")
            device = getattr(experts, name).device
            projections.append((
                torch.empty(num_experts, rows, cols // 2, dtype=torch.uint8, device=device),
                torch.empty(num_experts, rows, cols // BLOCK, dtype=torch.float8_e4m3fn, device=device),
                torch.empty(num_experts, rows, dtype=torch.float32, device=device),
            ))  # fmt: skip
        return cls(*projections)

    @classmethod
    @torch.no_grad()
    def from_experts(cls, experts: Experts) -> Nvfp4Experts:
        """Quantized a chunk of rows at a time (row_chunks.py): quantize_nvfp4's temporaries hold
        ~180 bytes a weight, 140 GB for a 35B-A3B layer's experts at once."""
        placeholder = cls.placeholder(experts)
        for name in PROJECTIONS:
            placeholder.quantize_into(name, None, getattr(experts, name).detach())
        return placeholder

    def quantize_into(self, projection: str, index, value: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Quantize bf16 expert weights into `projection`: value is the weight at `index` (None: all
        experts; an expert; or (expert, rows)), rounded to dtype first when given (as an
        unquantized load would hold it). Each row gets its own scale (row_chunks.py)."""
        targets = self.operands(projection)
        quantize_rows_into(value, targets if index is None else [t[index] for t in targets], quantize_nvfp4, dtype)

    def load_stored(self, projection: str, write: StoredWrite, dtype: torch.dtype | None = None) -> None:
        """A checkpoint's write into a projection (all experts, one, or an expert's rows): NVFP4
        codes with their scales as stored (the tensor's global scale as its rows' scale),
        anything else dequantized and quantized."""
        codes, block_scale, row_scale = self.operands(projection)
        if write.nvfp4_scales is None:
            shape = write.target(codes).shape
            self.quantize_into(projection, write.index, write.dense((*shape[:-1], shape[-1] * 2)), dtype)  # two codes a byte
            return
        stored_block, stored_row = write.nvfp4_scales
        write.copy_into(codes)
        block_target, row_target = write.target(block_scale), write.target(row_scale)
        block_target.copy_(write.checked(stored_block, block_target.shape))
        row_target.copy_(stored_row.reshape(row_target.shape))

    def operands(self, projection: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, block_scale, row_scale) of `projection`."""
        return getattr(self, projection), getattr(self, projection + "_block_scale"), getattr(self, projection + "_row_scale")

    def scale_of(self, projection: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' scale argument for `projection`: (block_scale, row_scale)."""
        return self.operands(projection)[1:]

    @property
    def num_weights(self) -> int:
        return 2 * sum(getattr(self, name).numel() for name in PROJECTIONS)  # two codes a byte

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(
            x, weights, expert_ids, self.gate_up_proj, self.down_proj, self.scale_of("gate_up_proj"), self.scale_of("down_proj")
        )
