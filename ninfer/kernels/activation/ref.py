"""Gated activations in plain torch, with torch's roundings (each op rounds to the dtype)."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate|up projection: x [..., 2I] (gate columns first) -> silu(gate) * up [..., I]."""
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]) * x[..., inter:]


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate); gate is x's shape (attention output gate) or [..., 1] (MoE shared-expert gate)."""
    return x * torch.sigmoid(gate)
