"""FP8 e4m3 routed experts: the fused expert weights of an MoE layer in half the bytes.

Decode reads each chosen expert's weights once per step, so the 35B-A3B's experts (most of
its streamed bytes) halve with them. Weight-only: the kernels widen e4m3 tiles in registers
and keep activations in x's dtype (kernels/moe). Scales, like Fp8Linear's:
- per output row ([E, 2I], [E, H]): quantize_fp8_ on bf16 experts (--quantize fp8, the bench);
- 128 x 128 blocks ([E, ceil(2I/128), ceil(H/128)], [E, ceil(H/128), ceil(I/128)]): Qwen's FP8
  checkpoints, as stored;
- row blocks ([E, 2I, ceil(H/128)], [E, H, ceil(I/128)]): a checkpoint's per-expert gate and up
  whose 128-row blocks do not line up once fused (I not a multiple of 128), each row carrying
  its part's block scales.
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer.kernels.fp8_quant.ref import quantize_rows
from ninfer.kernels.gemv.ref import FP8, SCALE_BLOCK, quantize_blocks
from ninfer.kernels.moe import fused_experts
from ninfer.models.layers.moe import Experts
from ninfer.models.quant.row_chunks import quantize_rows_into
from ninfer.models.quant.stored_write import StoredWrite
from ninfer.models.weight_load_error import WeightLoadError

PROJECTIONS = ("gate_up_proj", "down_proj")  # the fused weights; each has "<name>_scale"
_EXPERTS_PER_STEP = 16  # from_experts_blocks' fp32 temporaries: 128 MB at the 35B-A3B shapes


class Fp8Experts(nn.Module):
    stored_weights = PROJECTIONS  # StoresCheckpointWrites

    def __init__(
        self, gate_up_proj: torch.Tensor, gate_up_scale: torch.Tensor, down_proj: torch.Tensor, down_scale: torch.Tensor
    ):
        """gate_up_proj [E, 2I, H] and down_proj [E, H, I] float8_e4m3fn; float32 scales in one
        of the layouts above (kernels/moe/ref.py)."""
        super().__init__()
        self.register_buffer("gate_up_proj", gate_up_proj)
        self.register_buffer("gate_up_proj_scale", gate_up_scale)
        self.register_buffer("down_proj", down_proj)
        self.register_buffer("down_proj_scale", down_scale)

    @classmethod
    def placeholder(cls, experts: Experts, rows_per_block: int | None) -> Fp8Experts:
        """An unfilled module shaped like `experts` (on its device, e.g. meta) with scales per output
        row (rows_per_block None) or per block of rows_per_block rows (128 or 1) x 128 columns."""
        weights = [getattr(experts, name) for name in PROJECTIONS]
        device = weights[0].device
        fp8 = [torch.empty(w.shape, dtype=FP8, device=device) for w in weights]
        scales = [torch.empty(scale_shape(w.shape, rows_per_block), dtype=torch.float32, device=device) for w in weights]
        return cls(fp8[0], scales[0], fp8[1], scales[1])

    @classmethod
    @torch.no_grad()
    def from_experts(cls, experts: Experts) -> Fp8Experts:
        """Scales per output row, quantized a chunk of rows at a time (row_chunks.py): an fp32
        copy of all of them would be 2 GB per 35B-A3B layer."""
        placeholder = cls.placeholder(experts, rows_per_block=None)
        for name in PROJECTIONS:
            placeholder.quantize_into(name, None, getattr(experts, name).detach())
        return placeholder

    @classmethod
    @torch.no_grad()
    def from_experts_blocks(cls, experts: Experts) -> Fp8Experts:
        """128 x 128 block scales, as Qwen's FP8 checkpoints store fused experts."""
        quantized = []
        for name in PROJECTIONS:
            weight = getattr(experts, name)
            codes = torch.empty(weight.shape, dtype=FP8, device=weight.device)
            scale = torch.empty(scale_shape(weight.shape, SCALE_BLOCK), dtype=torch.float32, device=weight.device)
            for start in range(0, weight.shape[0], _EXPERTS_PER_STEP):
                codes[start : start + _EXPERTS_PER_STEP], scale[start : start + _EXPERTS_PER_STEP] = quantize_blocks(
                    weight[start : start + _EXPERTS_PER_STEP], SCALE_BLOCK
                )
            quantized += [codes, scale]
        return cls(*quantized)

    def quantize_into(self, projection: str, index, value: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Quantize bf16 expert weights into `projection`'s layout, per output row or row
        blocks: value is the weight at `index` (None: all experts; an expert; or (expert,
        rows)), rounded to dtype first when given (as an unquantized load would hold it)."""
        rows_per_block = self.rows_per_block(projection)
        if rows_per_block == SCALE_BLOCK:
            raise ValueError(f"{projection}'s 128 x 128 block scales span rows; quantize_into writes row-local scales")
        weight, scale = getattr(self, projection), self.scale_of(projection)
        if rows_per_block is None:
            scale, quantize = scale.unsqueeze(-1), _quantize_rows
        else:
            quantize = _quantize_row_blocks
        targets = (weight, scale) if index is None else (weight[index], scale[index])
        quantize_rows_into(value, targets, quantize, dtype)

    def load_stored(self, projection: str, write: StoredWrite, dtype: torch.dtype | None = None) -> None:
        """A checkpoint's write into a projection (all experts, one, or an expert's rows): FP8
        values with their block scales as stored where the projection has block scales, with one
        scale per row where it has per-row scales; anything else dequantized and quantized into
        its layout."""
        rows_per_block = self.rows_per_block(projection)
        weight = write.target(getattr(self, projection))
        row_scale = write.one_scale_per_row() if rows_per_block is None else None
        if write.fp8_row_scales is not None and rows_per_block is not None:
            self._write_blocks(projection, write, write.checked(write.value, weight.shape), write.fp8_row_scales)
        elif row_scale is not None:  # per output row, as stored
            weight.copy_(write.checked(write.value, weight.shape))
            write.target(self.scale_of(projection)).copy_(row_scale)
        elif rows_per_block == SCALE_BLOCK:
            # 128 x 128 blocks span rows, so this one is quantized whole (an expert of a mixed checkpoint).
            value = write.dense(weight.shape)
            self._write_blocks(projection, write, value.to(dtype or value.dtype), None)
        else:
            self.quantize_into(projection, write.index, write.dense(weight.shape), dtype)

    def _write_blocks(
        self, projection: str, write: StoredWrite, value: torch.Tensor, row_scales: torch.Tensor | None
    ) -> None:
        """e4m3 values and their block scales (row_scales: a row per weight row) in the projection's
        layout, row blocks or 128 x 128 blocks (their slice of the fused scales); an unquantized
        value (row_scales None) is quantized into that layout."""
        rows_per_block = self.rows_per_block(projection)
        scale_index = write.index if rows_per_block == 1 else _block_index(write.index, write.what)
        if row_scales is None:
            value, scales = quantize_blocks(value, rows_per_block)
        else:  # a write starting on a block's first row: every 128th row is the next block's scales
            scales = row_scales[..., ::rows_per_block, :]
        scale = self.scale_of(projection)
        scale_target = scale if scale_index is None else scale[scale_index]
        if tuple(scale_target.shape) != tuple(scales.shape):
            raise WeightLoadError(
                f"{write.what} has scales of shape {tuple(scales.shape)} for {projection}, whose scales there "
                f"take {tuple(scale_target.shape)}"
            )
        write.target(getattr(self, projection)).copy_(value)
        scale_target.copy_(scales)

    def scale_of(self, projection: str) -> torch.Tensor:
        return getattr(self, projection + "_scale")

    def rows_per_block(self, projection: str) -> int | None:
        """Weight rows per scale row of `projection`: None (per output row), 128 or 1."""
        weight, scale = getattr(self, projection), self.scale_of(projection)
        if scale.dim() == 2:
            return None
        return 1 if scale.shape[1] == weight.shape[1] else SCALE_BLOCK

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(
            x, weights, expert_ids, self.gate_up_proj, self.down_proj, self.gate_up_proj_scale, self.down_proj_scale
        )


def _block_index(index, what: str):
    """An expert write's index into the weight [E, N, K] -> into its 128 x 128 block scales."""
    if not isinstance(index, tuple):
        return index  # all experts, or one
    expert, rows = index
    first = rows.start or 0
    if first % SCALE_BLOCK:
        raise WeightLoadError(f"{what}: its rows from {first} do not start a {SCALE_BLOCK}-row scale block")
    return expert, slice(first // SCALE_BLOCK, -(-rows.stop // SCALE_BLOCK))


def _quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [N, K] -> (e4m3 [N, K], fp32 scales [N, 1]), one scale per row."""
    return quantize_rows(rows, row_multiple=1)


def _quantize_row_blocks(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [N, K] -> (e4m3 [N, K], fp32 scales [N, ceil(K/128)]), one scale per row and 128 columns."""
    return quantize_blocks(rows, 1)


def scale_shape(weight_shape: tuple[int, ...], rows_per_block: int | None) -> tuple[int, ...]:
    """The scales of an expert weight [E, N, K]: [E, N] per output row, else one per block of
    rows_per_block rows x 128 columns."""
    num_experts, rows, cols = weight_shape
    if rows_per_block is None:
        return (num_experts, rows)
    return (num_experts, -(-rows // rows_per_block), -(-cols // SCALE_BLOCK))
