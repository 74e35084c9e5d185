"""Attention input prep reference: per-head q/k RMSNorm, rotary, then K/V into the paged cache.

Exactly the steps the attention layer ran one by one (the rms_norm, apply_rotary and
store_kv references), in the same order and dtype, so this stays the same math as before
the fusion; triton.py does it in one launch.
"""

from __future__ import annotations

import torch

from ninfer.kernels.paged_attention.ref import store_kv
from ninfer.kernels.rms_norm.ref import rms_norm
from ninfer.kernels.rotary.ref import apply_rotary


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
    """q: [T, Hq, D]; k, v: [T, Hk, D]; norm weights [D] or both None; cos/sin [T, rotary_dim].

    Caches [P, page_size, Hk, D] get the normed, rotated k and v at slot_mapping [T]
    (page * page_size + offset), cast to the cache dtype. Returns the normed, rotated q as
    a new contiguous [T, Hq, D] in q's dtype.
    """
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q and k norms come together or not at all")
    if q_norm_weight is not None:
        q = rms_norm(q, q_norm_weight, eps, zero_centered)
        k = rms_norm(k, k_norm_weight, eps, zero_centered)
    q, k = apply_rotary(q, k, cos, sin)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q.contiguous()
