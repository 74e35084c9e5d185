"""NVFP4 weights: the torch reference of their layout, quantization and product.

A weight [N, K] is stored as
  weight       uint8 [N, K/2]: two e2m1 codes a byte, element 2j in the low nibble, 2j+1 in
               the high one (NVIDIA ModelOpt's packing); code bit 3 is the sign, bits 0-2
               index E2M1_VALUES;
  block_scale  float8_e4m3fn [N, K/16]: one scale per 16 consecutive elements of a row;
  row_scale    float32 [N]: a per-row factor. ModelOpt stores one global `weight_scale_2`
               per tensor; a packed projection's parts keep theirs, so it becomes per row.
and the weight is  value(code) * block_scale * row_scale, computed in fp32 (block_scale *
row_scale may need more than fp32's 24 bits, so products in another order can differ in the
last bit).

Hopper has no FP4 tensor cores: decode widens the codes in registers (weight-only GEMV),
prefill dequantizes to the activation dtype for the tensor cores.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
BLOCK = 16  # elements per block scale
MAX_ROWS = 16  # the largest M the fast path takes; larger batches go to nvfp4_gemm


def _code_values(device: torch.device) -> torch.Tensor:
    """The 16 codes' values: 0-7 positive, 8-15 their negatives."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def unpack_codes(weight: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> int64 codes [..., K] (low nibble first)."""
    low = weight & 0x0F
    high = weight >> 4
    return torch.stack((low, high), dim=-1).flatten(-2).long()


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """int codes [..., K] (0..15) -> uint8 [..., K/2]."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def dequantize_nvfp4(weight: torch.Tensor, block_scale: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """-> float32 [N, K]."""
    values = _code_values(weight.device)[unpack_codes(weight)]
    rows, cols = values.shape
    scales = block_scale.float() * row_scale.float().reshape(-1, 1)
    return (values.view(rows, cols // BLOCK, BLOCK) * scales.unsqueeze(-1)).view(rows, cols)


def gemv_nvfp4(
    x: torch.Tensor,
    weight: torch.Tensor,
    block_scale: torch.Tensor,
    row_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype, accumulated in float32."""
    out = x.float() @ dequantize_nvfp4(weight, block_scale, row_scale).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@torch.no_grad()
def quantize_nvfp4(
    weight: torch.Tensor, row_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] (K a multiple of 16) -> (packed, block_scale, row_scale), ModelOpt's recipe
    with the global scale per row: row_scale = row amax / (6 * 448), each block's scale its amax / 6
    in units of row_scale (rounded to e4m3), each value the nearest e2m1 code of value / scale
    (ties to the even code).
    row_scale: given scales instead (ModelOpt's one per tensor, repeated per row)."""
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"NVFP4 needs a multiple of {BLOCK} input features, not {cols}")
    w = weight.float()
    if row_scale is None:
        row_scale = w.abs().amax(dim=1) * (1.0 / (E2M1_MAX * E4M3_MAX))
    row_scale = row_scale.float().clamp(min=torch.finfo(torch.float32).tiny)
    blocks = w.view(rows, cols // BLOCK, BLOCK)
    block_amax = blocks.abs().amax(dim=-1)
    # Times the fp32 reciprocal, not / 6: torch on CUDA divides by a Python scalar that way and the
    # CPU exactly, so only the product gives the same scale bits on every device and in the kernels.
    block_scale = (block_amax * (1.0 / E2M1_MAX) / row_scale[:, None]).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    scale = block_scale.float() * row_scale[:, None]
    scaled = torch.where(scale[..., None] > 0, blocks / scale[..., None].clamp(min=1e-30), torch.zeros_like(blocks))
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
    distance = (scaled.abs().unsqueeze(-1) - magnitudes).abs()
    # Round to nearest, ties to the even code (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0), as FP casts do.
    nearest_codes = distance == distance.amin(dim=-1, keepdim=True)
    preference = nearest_codes * (2 - torch.arange(8, device=w.device) % 2)
    nearest = preference.argmax(dim=-1)
    codes = nearest + 8 * ((scaled < 0) & (nearest > 0)).long()
    return pack_codes(codes.view(rows, cols)), block_scale, row_scale


def kernel_operands(
    op: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    block_scale: torch.Tensor,
    row_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The fast kernels' preconditions on x [M, K] and the layout above (ValueError naming the
    operand that does not fit) -> (x, row_scale, bias) in the strides the kernels read."""
    rows, cols = x.shape
    num_out = weight.shape[0]
    if cols % BLOCK:
        raise ValueError(f"NVFP4 {op} needs K a multiple of {BLOCK}, got x {tuple(x.shape)}")
    if weight.dtype != torch.uint8 or tuple(weight.shape) != (num_out, cols // 2) or weight.stride(1) != 1:
        raise ValueError(f"weight must be uint8 [N, {cols // 2}] with unit last stride, got {weight.dtype} {tuple(weight.shape)}")
    expected_scales = (num_out, cols // BLOCK)
    if block_scale.dtype != torch.float8_e4m3fn or tuple(block_scale.shape) != expected_scales or block_scale.stride(1) != 1:
        raise ValueError(
            f"block_scale must be float8_e4m3fn {expected_scales} with unit last stride,"
            f" got {block_scale.dtype} {tuple(block_scale.shape)}"
        )
    if tuple(row_scale.shape) != (num_out,):
        raise ValueError(f"row_scale must be [{num_out}], got {tuple(row_scale.shape)}")
    if bias is not None and tuple(bias.shape) != (num_out,):
        raise ValueError(f"bias must be [{num_out}], got {tuple(bias.shape)}")
    row_scale = row_scale.float().contiguous()  # no copy for the usual fp32 scales
    bias = None if bias is None else bias.contiguous()
    return (x if x.stride(1) == 1 else x.contiguous()), row_scale, bias
