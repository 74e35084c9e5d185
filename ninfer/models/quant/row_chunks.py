"""Quantize a weight a bounded number of rows at a time, into a module's codes and scales.

Every quantization that goes through here is row-local: a row's codes and scales depend on
that row alone (per-row FP8 and NVFP4 scales come from the row's amax). Quantizing a matrix
chunk by chunk therefore gives the same bits as quantizing it whole, while the temporaries of
one quantization exist for one chunk only. They are large: NVFP4's nearest-code search holds
eight fp32 distances and eight int64 preferences per weight, so a 27B model's gate_up_proj
(178M weights) quantized at once needs ~30 GB.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

CHUNK_ELEMENTS = 1 << 21  # weights per quantized chunk (whole rows; one row if a row is longer)
# Peak bytes a chunk's quantization holds per weight, the chunk's copy on the device included:
# NVFP4 measured 177 (quantize_nvfp4's temporaries) + 2 (the bf16 chunk); FP8 per row, 14.
WORKSPACE_BYTES_PER_ELEMENT = 192


def chunk_rows(num_columns: int, chunk_elements: int | None = None) -> int:
    """Rows per chunk for rows of `num_columns` weights (default chunk: CHUNK_ELEMENTS)."""
    return max(1, (chunk_elements or CHUNK_ELEMENTS) // max(1, num_columns))


def workspace_bytes(largest_row: int = 0, chunk_elements: int | None = None) -> int:
    """The most memory quantize_rows_into holds beyond its outputs on their device, for rows of
    at most `largest_row` weights (a chunk is one such row when a row exceeds the chunk)."""
    return max(chunk_elements or CHUNK_ELEMENTS, largest_row) * WORKSPACE_BYTES_PER_ELEMENT


@torch.no_grad()
def quantize_rows_into(
    value: torch.Tensor,
    outputs: Sequence[torch.Tensor],
    quantize: Callable[[torch.Tensor], Sequence[torch.Tensor]],
    dtype: torch.dtype | None = None,
    chunk_elements: int | None = None,
) -> None:
    """Write quantize(rows) for each chunk of rows of value [..., R, K] into `outputs` (each
    [..., R, ...]: views of a module's codes and scales, shaped as quantize's results), one
    chunk at a time. Each chunk moves to the outputs' device and dtype (default: value's)
    before it is quantized, so a weight arriving on the CPU is never whole on the device."""
    *lead, num_rows, num_columns = value.shape
    device = outputs[0].device
    if device.type == "meta":
        return  # shapes only (a model laid out without storage): there are no values to write
    step = chunk_rows(num_columns, chunk_elements)
    for lead_index in itertools.product(*(range(size) for size in lead)):
        for start in range(0, num_rows, step):
            index = (*lead_index, slice(start, start + step))
            chunk = value[index].to(device=device, dtype=dtype or value.dtype)
            results = quantize(chunk)
            if len(results) != len(outputs):
                raise ValueError(f"quantize gave {len(results)} tensors for {len(outputs)} outputs")
            for output, result in zip(outputs, results):
                output[index].copy_(result)
