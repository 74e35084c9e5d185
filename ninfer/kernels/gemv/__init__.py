"""out = x @ W^T (+ bias) for decode-sized batches (M <= MAX_ROWS), bf16 or FP8 weights: see ref.py."""

import torch
import torch.nn.functional as F

from ninfer.kernels.backend import fast_impl
from ninfer.kernels.gemv import ref
from ninfer.kernels.gemv.ref import MAX_ROWS



def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    impl = (fast_impl(__name__, "gemv", x) if x.shape[0] <= MAX_ROWS else None) or ref.gemv
    return impl(x, weight, weight_scale, bias)


# Unquantized weights: the largest row count where the GEMV kernel beats cuBLAS on the H200
# (bench_gemv.py on the 27B shapes: 4-12 % faster than F.linear at M = 1 and 2; at par or
# behind from M = 4).
UNQUANTIZED_GEMV_MAX_ROWS = 2


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) for unquantized weights: the GEMV kernel where it is the
    faster path (CUDA, few rows), else F.linear (CPU, prefill, larger decode batches)."""
    rows = x.reshape(-1, x.shape[-1])
    if x.is_cuda and rows.shape[0] <= UNQUANTIZED_GEMV_MAX_ROWS:
        return gemv(rows, weight, None, bias).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
