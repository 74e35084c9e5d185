"""out = x @ W^T (+ bias) for decode-sized batches (M <= MAX_ROWS), bf16, fp16 or FP8 weights: see ref.py."""

import torch
import torch.nn.functional as F

from ninfer.kernels.activation import silu_and_mul
from ninfer.kernels.backend import dispatched
from ninfer.kernels.causal_conv1d import causal_conv1d_update
from ninfer.kernels.gemv import ref
from ninfer.kernels.gemv.ref import MAX_ROWS


def _decode_sized(x: torch.Tensor) -> bool:
    """The GEMV kernels take up to MAX_ROWS rows; larger batches run the reference."""
    return x.shape[0] <= MAX_ROWS


gemv = dispatched(__name__, ref.gemv, fast_when=_decode_sized)
gemv_silu_and_mul = dispatched(__name__, ref.gemv_silu_and_mul, fast_when=_decode_sized)
gemv_causal_conv1d_update = dispatched(__name__, ref.gemv_causal_conv1d_update, fast_when=_decode_sized)


# Unquantized weights: the GEMV kernel up to 16 rows (bench_gemv.py on the 27B shapes: 4-12 %
# faster than F.linear at M = 1 and 2 on the FMA path, 2-10 % at M = 4 and 16 on DOT; at 24 and
# 32 rows from 2 % slower on 5120-row matrices to 9 % faster on the widest, against FP8's 20-40 %).
UNQUANTIZED_GEMV_MAX_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) for unquantized weights: the GEMV kernel where it is the
    faster path (CUDA, few rows), else F.linear (CPU, prefill, larger decode batches)."""
    rows = x.reshape(-1, x.shape[-1])
    if x.is_cuda and rows.shape[0] <= UNQUANTIZED_GEMV_MAX_ROWS:
        return gemv(rows, weight, None, bias).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


# float16 weights on the CPU (models/quant/half_weights.py): up to this many rows the float16
# GEMV (gemv/cpu.py) is the faster route; it makes one pass over the weight per row, so from
# 4 rows widening the weight for one fp32 GEMM wins (2 cores: 0.18 vs 0.31 ms at 1 row,
# 0.35 vs 0.38 at 2, 0.67 vs 0.56 at 4, for a 3072 x 576 weight).
HALF_WEIGHT_GEMV_MAX_ROWS = 2


def linear_half_weight(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) for a float16 weight and float32 x: the float16 GEMV at
    decode sizes, else the weight widened to x's dtype for one GEMM (prefill)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= HALF_WEIGHT_GEMV_MAX_ROWS:
        return gemv(rows, weight, None, bias).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight.to(x.dtype), bias)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of linear(x, weight, bias) for a gate | up weight [2I, K]: at GEMV sizes
    in one launch (the activation in the GEMV's epilogue), else the product then the activation."""
    rows = x.reshape(-1, x.shape[-1])
    if x.is_cuda and rows.shape[0] <= UNQUANTIZED_GEMV_MAX_ROWS:
        return gemv_silu_and_mul(rows, weight, None, bias).reshape(*x.shape[:-1], weight.shape[0] // 2)
    return silu_and_mul(F.linear(x, weight, bias))


def linear_causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """linear(x, weight, bias) [B, N] of one decode token per request, with the conv's decode
    step on its first conv_weight.shape[0] columns: at GEMV sizes in the GEMV's epilogue."""
    if x.is_cuda and x.shape[0] <= UNQUANTIZED_GEMV_MAX_ROWS:
        return gemv_causal_conv1d_update(x, weight, None, bias, conv_weight, conv_state, state_slots)
    return conv_first_columns(F.linear(x, weight, bias), conv_weight, conv_state, state_slots)


def conv_first_columns(
    out: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor
) -> torch.Tensor:
    """A projection's output [B, N] with its first conv_weight.shape[0] columns through
    causal_conv1d_update (two launches and a copy: the path where the GEMV cannot fuse it)."""
    channels = conv_weight.shape[0]
    return torch.cat((causal_conv1d_update(out[:, :channels], conv_weight, conv_state, state_slots), out[:, channels:]), 1)
