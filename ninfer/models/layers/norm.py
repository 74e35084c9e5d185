"""RMSNorm modules; the math lives in ninfer.kernels.rms_norm."""

import torch
from torch import nn

from ninfer.kernels.rms_norm import add_rms_norm, gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """zero_centered=True is Qwen3.5/Qwen3-Next's (1 + w) form (weight stored as w, initialised 0)."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one pass: a pre-norm layer's residual add and norm.

        The residual is always an earlier norm's sum (or the layer input) with at least a GEMV
        launched since, so the kernel may read it before its PDL wait."""
        return add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered, early_residual=True)


class GatedRMSNorm(nn.Module):
    """Gated DeltaNet output norm: plain w, gated by silu(z)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, *, early_gate: bool = False) -> torch.Tensor:
        """early_gate: the gate was written before the launch just before this one (a PDL hint)."""
        return gated_rms_norm(x, gate, self.weight, self.eps, early_gate=early_gate)
