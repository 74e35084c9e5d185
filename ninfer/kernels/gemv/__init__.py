"""out = x @ W^T (+ bias) for decode-sized batches (M <= MAX_ROWS), bf16 or FP8 weights: see ref.py."""

import torch

from ninfer.kernels.backend import fast_impl
from ninfer.kernels.gemv import ref

MAX_ROWS = 16  # the largest M the fast path takes; larger batches go to ref (a plain matmul)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    impl = (fast_impl(__name__, "gemv", x) if x.shape[0] <= MAX_ROWS else None) or ref.gemv
    return impl(x, weight, weight_scale, bias)
