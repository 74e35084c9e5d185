"""StoredWrite.narrowed: a tensor-parallel rank's cut of a quantized checkpoint write keeps the stored
bits where the scale blocks allow (any row cut; a column cut on a block boundary or inside one
block) and dequantizes exactly otherwise; whichever it does, the cut dequantizes to the same
slice of the whole write."""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.gemv.ref import SCALE_BLOCK, quantize_blocks
from ninfer.kernels.nvfp4_gemv.ref import E2M1_MAX, E4M3_MAX, quantize_nvfp4
from ninfer.models.quant.stored_write import StoredWrite


def fp8_write(rows: int, cols: int) -> StoredWrite:
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)) * 0.1
    values, scale_inv = quantize_blocks(weight, SCALE_BLOCK)  # one scale per 128 x 128 block
    row_scales = scale_inv.repeat_interleave(SCALE_BLOCK, dim=0)[:rows]  # a row per weight row, as writes carry them
    return StoredWrite("w", "w", None, values, fp8_row_scales=row_scales)


def nvfp4_write(rows: int, cols: int) -> StoredWrite:
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols)) * 0.1
    global_scale = weight.abs().amax() / (E2M1_MAX * E4M3_MAX)
    codes, block_scale, row_scale = quantize_nvfp4(weight, global_scale.expand(rows))
    return StoredWrite("w", "w", None, codes, nvfp4_scales=(block_scale, row_scale))


FORMATS = {"fp8": fp8_write, "nvfp4": nvfp4_write}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize(
    "dim, start, length, kept",
    [
        (0, 96, 160, True),  # rows: always as stored
        (1, 128, 128, True),  # columns from a 128-column block boundary
        (1, 256, 192, True),  # ... to the end, the last block partial
        (1, 160, 64, True),  # inside one 128-column block (NVFP4: 16-value groups)
        (1, 96, 64, None),  # across two 128-column blocks: FP8 dequantized, NVFP4 kept
        (1, 120, 24, False),  # across blocks and not on 16-value groups: dequantized in both formats
    ],
)  # fmt: skip
def test_a_cut_dequantizes_to_the_slice_of_the_whole(fmt, dim, start, length, kept):
    write = FORMATS[fmt](384, 448)
    cut = write.narrowed(dim, start, length)
    assert torch.equal(cut.dequantized(), write.dequantized().narrow(dim, start, length))
    stays_quantized = cut.fp8_row_scales is not None or cut.nvfp4_scales is not None
    assert stays_quantized == (kept if kept is not None else fmt == "nvfp4")
    if stays_quantized and fmt == "fp8" and dim == 1:  # the blocks the cut's columns lie in
        assert cut.fp8_row_scales.shape[1] == -(-(start + length) // SCALE_BLOCK) - start // SCALE_BLOCK
    if not stays_quantized:
        assert cut.value.dtype == torch.float32 and cut.value.shape == write.dequantized().narrow(dim, start, length).shape


def test_an_unquantized_write_is_a_plain_slice():
    value = torch.arange(24.0).reshape(4, 6)
    cut = StoredWrite("w", "w", None, value).narrowed(1, 2, 3)
    assert torch.equal(cut.value, value[:, 2:5]) and cut.fp8_row_scales is None and cut.nvfp4_scales is None


def test_a_per_channel_weight_keeps_its_bits_across_blocks():
    """One scale per row, repeated per 128-column block (how a per-channel FP8 weight travels as a
    write): any column cut keeps the codes, and the per-row scale comes back out of it."""
    weight = torch.randn(64, 448, generator=torch.Generator().manual_seed(5))
    scale = weight.abs().amax(dim=1) / 448
    codes = (weight / scale[:, None]).to(torch.float8_e4m3fn)
    write = StoredWrite("w", "w", None, codes, fp8_row_scales=scale[:, None].expand(64, 4))
    cut = write.narrowed(1, 96, 200)  # across blocks 0, 1 and 2, on no boundary
    assert cut.fp8_row_scales is not None and cut.fp8_row_scales.shape == (64, 2)
    assert torch.equal(cut.value.view(torch.uint8), codes[:, 96:296].view(torch.uint8))
    assert torch.equal(cut.dequantized(), write.dequantized()[:, 96:296])
    assert torch.equal(cut.one_scale_per_row(), scale)
    assert fp8_write(64, 448).one_scale_per_row() is None  # 128 x 128 blocks of their own scales
