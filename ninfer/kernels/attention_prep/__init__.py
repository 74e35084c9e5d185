import torch

from ninfer.kernels.attention_prep import ref
from ninfer.kernels.backend import fast_impl


def prepare_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    zero_centered: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """q/k RMSNorm (optional) + rotary + K/V cache write; returns the new q (see ref.py)."""
    impl = fast_impl(__name__, "prepare_qkv", q) or ref.prepare_qkv
    return impl(q, k, v, q_norm_weight, k_norm_weight, eps, zero_centered, cos, sin, k_cache, v_cache, slot_mapping)
