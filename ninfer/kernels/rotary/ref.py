"""Rotary position embedding (neox rotate_half form) on the first rotary_dim dims."""

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D], cos/sin: [T, rotary_dim] in q's dtype.

    Dims past rotary_dim pass through unchanged (partial RoPE).
    """
    rotary_dim = cos.shape[-1]
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        rot = rot * cos + _rotate_half(rot) * sin
        return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot

    return rotate(q), rotate(k)
