"""Per-row FP8 quantization of activations (reference): the input of torch._scaled_mm.

Each row gets its own scale, amax * (1 / 448) (448: e4m3's largest finite value), so the row's
largest magnitude maps onto 448; rows are padded with zeros (scale 1) to a multiple of
`row_multiple`, as _scaled_mm wants. All-zero rows take the scale of amax 1e-12.
"""

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12
INV_FP8_MAX = 1.0 / FP8_MAX  # becomes the fp32 reciprocal in torch and in Triton alike


def row_scales(amax: torch.Tensor) -> torch.Tensor:
    """Per-row amax [M, 1] -> fp32 scales, as a multiply by the fp32 reciprocal of 448: what
    torch on CUDA does for "/ 448" anyway, and one IEEE product that a kernel can repeat
    (torch on the CPU would divide, and a division in a kernel need not round the same)."""
    return amax.float().clamp(min=MIN_AMAX) * INV_FP8_MAX


def quantize_rows(x: torch.Tensor, row_multiple: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (e4m3 [M', K], fp32 scales [M', 1]) with M' = M rounded up to row_multiple."""
    scale = row_scales(x.abs().amax(dim=1, keepdim=True))
    quantized = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    num_rows = x.shape[0]
    padded = -(-num_rows // row_multiple) * row_multiple
    if padded != num_rows:
        quantized = F.pad(quantized.view(torch.uint8), (0, 0, 0, padded - num_rows)).view(FP8)
        scale = F.pad(scale, (0, 0, 0, padded - num_rows), value=1.0)
    return quantized, scale
