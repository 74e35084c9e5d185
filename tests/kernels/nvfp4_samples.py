"""Random NVFP4 operands over their whole ranges, and the exact product the kernels are held to
(shared by the NVFP4 GEMV and GEMM tests)."""

from __future__ import annotations

import torch

from ninfer.kernels.nvfp4_gemv import ref

E4M3 = torch.float8_e4m3fn


def random_weights(n: int, k: int, seed: int, device: str = "cpu"):
    """(packed, block_scale, row_scale): all 16 codes; block scales from e4m3 subnormals to 448
    with a fifth of the blocks zero; row scales 2^-6..2^2."""
    gen = torch.Generator(device).manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8, device=device)
    exponent = torch.randint(-9, 9, (n, k // ref.BLOCK), generator=gen, device=device)
    scale = (1 + torch.rand(n, k // ref.BLOCK, generator=gen, device=device)) * 2.0**exponent
    scale[torch.rand(scale.shape, generator=gen, device=device) < 0.2] = 0.0  # zero blocks
    block_scale = scale.clamp(max=ref.E4M3_MAX).to(E4M3)
    row_scale = 2.0 ** torch.empty(n, device=device).uniform_(-6, 2, generator=gen)
    return packed, block_scale, row_scale


def random_activations(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    """(x [m, k], bias [n]) in dtype."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)


def exact_product(x, packed, block_scale, row_scale, bias=None) -> torch.Tensor:
    """x @ W^T (+ bias) in float64 from the reference's dequantized weight."""
    exact = x.double() @ ref.dequantize_nvfp4(packed, block_scale, row_scale).double().T
    return exact if bias is None else exact + bias.double()
