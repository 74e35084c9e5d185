"""Block-scaled FP8 GEMM through cuBLAS: torch's scaled_mm with its blockwise scaling recipes
(cuBLAS 12.9+ on sm_90), the product of ref.block_fp8_matmul on cuBLAS's own kernels.

Each 128-column group's e4m3 product is scaled by its row's and column's scales and summed in
fp32, as in ref.py and the Triton kernel; cuBLAS overlaps those promotions with the next
group's tensor-core work, where the Triton kernel waits on each group.

Layouts cuBLAS takes: x e4m3 [M, K] row-major with M a multiple of 16 (padded here), its
scales [M, K/128] fp32 column-major (quantize_groups writes them so); the weight e4m3 [N, K]
row-major, seen as a column-major [K, N]; its scales either per 128 x 128 block
([ceil(N/128), K/128], passed transposed, the K blocks padded to a multiple of 4) or per row and
128 columns ([N, K/128], column-major). K must be a multiple of 128.

Whether torch and cuBLAS have it is found once per device and scale layout, by a small product
compared with the reference, never inside a graph capture (its first call there keeps the Triton
kernel); where they have not, fp8_linear keeps the Triton kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.kernels.fp8_gemm import ref
from ninfer.kernels.fp8_quant.ref import FP8
from ninfer.kernels.gemv.ref import SCALE_BLOCK, scale_rows_per_block
from ninfer.kernels.route_probe import RouteProbe

ROW_MULTIPLE = 16  # x rows padded to this: the scales' column-major leading dimension stays 16-byte aligned
_SCALE_COLUMN_MULTIPLE = 4  # K blocks of a transposed 128 x 128 scale tensor: 16-byte aligned rows
# Both sum each group in the tensor cores' own precision: they agree to a few e4m3 products' rounding.
PROBE = RouteProbe("cuBLAS's blockwise FP8 product", "block-scaled FP8 prefill keeps the Triton kernel", 1e-2)


def _recipes():
    """(1 x 128, 128 x 128) scaling recipes, or None where this torch has no blockwise scaled_mm."""
    scaling = getattr(F, "ScalingType", None)
    if scaling is None or not hasattr(F, "scaled_mm"):
        return None
    try:
        return scaling.BlockWise1x128, scaling.BlockWise128x128
    except AttributeError:
        return None


def eligible(x_fp8: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """The shapes and layouts cuBLAS's blockwise FP8 product takes (whether it works: supported())."""
    cols, out_features = x_fp8.shape[1], weight.shape[0]
    rows_per_scale = scale_rows_per_block(weight, weight_scale)
    # 128 x 128 blocks over whole blocks of rows only: a partial last block is not in the probe.
    return (
        x_fp8.is_cuda and cols % SCALE_BLOCK == 0 and weight.stride(1) == 1 and out_features % 16 == 0
        and (rows_per_scale == 1 or (rows_per_scale == SCALE_BLOCK and out_features % SCALE_BLOCK == 0))
        and _recipes() is not None
    )  # fmt: skip


def matmul(x_fp8, x_scale, weight, weight_scale, out_dtype, bias=None) -> torch.Tensor:
    """ref.block_fp8_matmul's product on cuBLAS (eligible() shapes; x_scale as quantize_groups
    returns it, or any [M, K/128] layout)."""
    one_by_128, block_128 = _recipes()
    rows = x_fp8.shape[0]
    padded_rows = -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE
    if padded_rows != rows:
        x_fp8 = F.pad(x_fp8.view(torch.uint8), (0, 0, 0, padded_rows - rows)).view(FP8)
        x_scale = F.pad(x_scale.float(), (0, 0, 0, padded_rows - rows), value=1.0)
    x_scale = x_scale.float()
    if x_scale.stride(0) != 1:
        x_scale = x_scale.t().contiguous().t()  # column-major
    if scale_rows_per_block(weight, weight_scale) == 1:
        w_scale, w_recipe = weight_scale.float().t().contiguous().t(), one_by_128
    else:
        blocks = weight_scale.float()
        blocks = F.pad(blocks, (0, -blocks.shape[1] % _SCALE_COLUMN_MULTIPLE))
        w_scale, w_recipe = blocks.t(), block_128
    out = F.scaled_mm(
        x_fp8, weight.t(), x_scale, one_by_128, w_scale, w_recipe, output_dtype=out_dtype
    )[:rows]
    return out if bias is None else out + bias.to(out.dtype)


def supported(device: torch.device, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """Whether cuBLAS computes the product right for this weight's scale layout on `device`: a
    40 x 512 x 256 product against the reference, once per device and layout (PROBE)."""
    rows_per_scale = scale_rows_per_block(weight, weight_scale)
    return PROBE.supported(device, rows_per_scale, lambda: _probe_problem(device, rows_per_scale))


def _probe_problem(device: torch.device, rows_per_scale: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(0)
    rows, cols, out_features = 40, 512, 256  # 40 rows: the padding path too
    x = torch.randn(rows, cols, generator=generator, device=device, dtype=torch.bfloat16)
    weight = torch.randn(out_features, cols, generator=generator, device=device).clamp(-400, 400).to(FP8)
    scale_rows = out_features if rows_per_scale == 1 else out_features // SCALE_BLOCK
    weight_scale = torch.rand(scale_rows, cols // SCALE_BLOCK, generator=generator, device=device) + 0.5
    x_fp8, x_scale = ref.quantize_groups(x)
    expected = ref.block_fp8_matmul(x_fp8, x_scale, weight, weight_scale, torch.float32)
    return matmul(x_fp8, x_scale, weight, weight_scale, torch.float32), expected
