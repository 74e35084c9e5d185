"""Skinny matmul for CPU tensors: float16 weights with float32 activations (see ref.py).

Decode on a CPU is bound by the weight bytes it streams per token. torch's float16 GEMV
widens the weights in registers and accumulates in fp32, and on x86 streams them at ~1.4x
the byte rate of the fp32 GEMV (2.5-3x the weights per second on 2 cores). It takes both
operands in float16, so the activations are rounded to float16 on the way in (2^-11
relative, like the weights) and the product once on the way out. A product that leaves
float16's range (or an input already outside it) is recomputed by the reference.
Other dtypes and scaled (FP8) weights go to the reference unchanged. The GEMV makes one
pass over the weight per row, so callers send it decode rows only (linear_half_weight).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ninfer.kernels.backend import fast_version
from ninfer.kernels.gemv import ref


@fast_version(ref.gemv)
def gemv(x, weight, weight_scale=None, bias=None):
    """x [M, K] float32, weight [N, K] float16, bias [N] -> [M, N] float32; otherwise ref.gemv."""
    if weight.dtype != torch.float16 or x.dtype != torch.float32 or weight_scale is not None:
        return ref.gemv(x, weight, weight_scale, bias)
    out = F.linear(x.to(torch.float16), weight).float()
    # One reduction finds an inf or nan (float16 values cannot overflow an fp32 sum);
    # torch.isfinite(...).all() costs 5x as much, 121 times per token on the default model.
    if not math.isfinite(out.sum().item()):
        return ref.gemv(x, weight, None, bias)
    if bias is not None:
        out += bias.float()
    return out
