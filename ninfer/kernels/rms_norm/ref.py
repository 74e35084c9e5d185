"""RMSNorm references, with each family's exact cast order (it matters in bf16)."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """Llama style: w * normalize(x).to(dtype); zero-centred (Qwen3.5): (normalize(x) * (1 + w)).to(dtype)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool = False,
    *,
    early_residual: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm residual step: (rms_norm(x + residual), x + residual), the sum rounded to its dtype first.

    early_residual: a launch hint for the fast version (see triton.py); the result is the same.
    """
    summed = x + residual
    return rms_norm(summed, weight, eps, zero_centered), summed


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *, early_gate: bool = False
) -> torch.Tensor:
    """Gated DeltaNet output norm: norm before gate, plain w, silu(gate) in fp32.

    early_gate: a launch hint for the fast version (see triton.py); the result is the same.
    """
    dtype = x.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(dtype)
    return (out * torch.nn.functional.silu(gate.float())).to(dtype)
