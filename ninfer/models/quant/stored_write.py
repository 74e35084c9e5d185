"""StoredWrite: one write of a checkpoint tensor into a parameter, in the format it is stored in.

A checkpoint rule turns a stored tensor into writes (a whole parameter, or rows or experts of
one); a quantized tensor's scales are sliced the same way, so each write carries the scales of
its own rows. Plain parameters take the value dequantized; a quantized module takes the write
itself (`StoresCheckpointWrites`) and either keeps the stored format or quantizes into its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch

from ninfer.kernels.gemv.ref import SCALE_BLOCK
from ninfer.kernels.nvfp4_gemv import dequantize_nvfp4
from ninfer.kernels.nvfp4_gemv.ref import BLOCK as NVFP4_BLOCK
from ninfer.models.weight_load_error import WeightLoadError


@dataclass(frozen=True)
class StoredWrite:
    what: str  # "<source>: tensor '<stored name>'", naming the write in errors
    param_name: str
    index: Any  # None: the whole parameter, else param[index]
    value: torch.Tensor  # unquantized, e4m3 values, or e2m1 codes two a byte
    fp8_row_scales: torch.Tensor | None = None  # e4m3 values: their 128-column block scales, a row per weight row
    nvfp4_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # e2m1 codes: (e4m3 per 16 values, fp32 per row)

    def target(self, tensor: torch.Tensor) -> torch.Tensor:
        """This write's place in `tensor` (the parameter, or a tensor laid out by its rows)."""
        return tensor if self.index is None else tensor[self.index]

    def checked(self, value: torch.Tensor, expected: Sequence[int]) -> torch.Tensor:
        """`value` (this write's, as stored or dequantized) if its shape is what the parameter expects."""
        if tuple(value.shape) != tuple(expected):
            raise WeightLoadError(
                f"{self.what} has shape {tuple(value.shape)}, "
                f"parameter {self.param_name!r}{'' if self.index is None else f'[{self.index}]'} "
                f"expects {tuple(expected)}"
            )
        return value

    def dense(self, expected: Sequence[int]) -> torch.Tensor:
        """The value dequantized exactly (as stored when unquantized), checked against `expected`."""
        return self.checked(self.dequantized(), expected)

    def dequantized(self) -> torch.Tensor:
        """The value dequantized exactly (as stored when unquantized)."""
        value = self.value
        if self.fp8_row_scales is not None:
            columns = self.fp8_row_scales.repeat_interleave(SCALE_BLOCK, dim=-1)[..., : value.shape[-1]]
            return value.float() * columns
        if self.nvfp4_scales is not None:
            block_scale, row_scale = self.nvfp4_scales
            flat_codes = value.reshape(-1, value.shape[-1])
            return dequantize_nvfp4(
                flat_codes, block_scale.reshape(flat_codes.shape[0], -1), row_scale.reshape(-1)
            ).reshape(*value.shape[:-1], value.shape[-1] * 2)
        return value

    def one_scale_per_row(self) -> torch.Tensor | None:
        """FP8 block scales that hold one value across each row (a per-channel weight written with
        its scale repeated per block): that value per row; else None."""
        scales = self.fp8_row_scales
        if scales is None or not bool((scales == scales[..., :1]).all()):
            return None
        return scales[..., 0]

    def narrowed(self, dim: int, start: int, length: int) -> StoredWrite:
        """The write of `length` elements from `start` along the value's dimension `dim`, counted in
        unquantized elements, with their scales (the index is the caller's to set). A quantized
        write keeps its stored bits where its scale blocks allow: any cut across rows, a cut across
        columns on a block boundary, inside one block, or across blocks of one scale per row. Any
        other column cut is dequantized exactly, and the module it fills quantizes it into its
        own blocks."""
        quantized = self.fp8_row_scales is not None or self.nvfp4_scales is not None
        if not quantized:
            return replace(self, value=self.value.narrow(dim, start, length))
        if dim < self.value.dim() - 1:  # rows: every scale tensor has the value's row dimensions
            fp8, nvfp4 = self.fp8_row_scales, self.nvfp4_scales
            return replace(
                self,
                value=self.value.narrow(dim, start, length),
                fp8_row_scales=None if fp8 is None else fp8.narrow(dim, start, length),
                nvfp4_scales=None if nvfp4 is None else tuple(s.narrow(dim, start, length) for s in nvfp4),
            )
        if self.fp8_row_scales is not None:
            first_block, end_block = start // SCALE_BLOCK, -(-(start + length) // SCALE_BLOCK)
            scales = self.fp8_row_scales[..., first_block:end_block]
            kept = None
            if start % SCALE_BLOCK == 0 or end_block - first_block == 1:
                kept = scales  # the cut's own 128-column blocks are these blocks (or inside the one)
            elif bool((scales == scales[..., :1]).all()):  # one scale per row (a per-channel weight)
                kept = scales[..., :1].expand(*scales.shape[:-1], -(-length // SCALE_BLOCK))
            if kept is not None:
                return replace(self, value=self.value.narrow(dim, start, length), fp8_row_scales=kept)
        elif start % NVFP4_BLOCK == 0 and length % NVFP4_BLOCK == 0:
            block_scale, row_scale = self.nvfp4_scales
            groups = block_scale.narrow(dim, start // NVFP4_BLOCK, length // NVFP4_BLOCK)
            return replace(self, value=self.value.narrow(dim, start // 2, length // 2), nvfp4_scales=(groups, row_scale))
        dense = self.dequantized().narrow(dim, start, length)
        return replace(self, value=dense, fp8_row_scales=None, nvfp4_scales=None)

    def copy_into(self, tensor: torch.Tensor) -> None:
        """The value as stored into its place in `tensor`."""
        target = self.target(tensor)
        target.copy_(self.checked(self.value, target.shape))

    def copy_dense_into(self, tensor: torch.Tensor) -> None:
        """The value dequantized into its place in `tensor` (a plain parameter)."""
        target = self.target(tensor)
        target.copy_(self.dense(target.shape))


@runtime_checkable
class StoresCheckpointWrites(Protocol):
    """A quantized module, whose weights (buffers) a checkpoint fills through the module."""

    stored_weights: tuple[str, ...]  # the attributes holding its weights, each one a checkpoint tensor's target

    def load_stored(self, attribute: str, write: StoredWrite, dtype: torch.dtype | None = None) -> None:
        """Write `write` into the weight `attribute` and its scales. dtype: the model's unquantized
        dtype, which an unquantized value is rounded to before it is quantized (None: as stored)."""
