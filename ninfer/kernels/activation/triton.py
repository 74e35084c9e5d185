"""SwiGLU (silu(gate) * up) and sigmoid gating in Triton: one launch instead of two or three.

Grid (rows, column blocks of BLOCK_N); each thread moves 16 bytes per operand, so a bf16
block of 1024 columns is one vector load per operand per thread on 4 warps. Math in fp32
with torch's roundings: silu(gate) and sigmoid(gate) round to the dtype before the multiply
(torch returns them as tensors of that dtype), then the product rounds once (a product of two
bf16/fp16 values is exact in fp32, so this equals torch's multiply in the narrow dtype).

Rows of x (and of a full-shape gate) may be strided views with a unit last-dim stride: the
leading dims are folded into (outer, inner) rows as in the RMSNorm kernels, so e.g. the
attention output gate [T, H, D] sliced out of the packed q projection is read in place.
Outputs are new contiguous tensors. Launch configuration depends only on shapes and dtypes:
CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.activation import ref
from ninfer.kernels.backend import fast_version
from ninfer.kernels.pdl import pdl_enabled, pdl_sync
from ninfer.kernels.rms_norm.triton import _row_start, rows_per_program, strided_rows

MAX_BLOCK_N = 1024


def block_config(num_cols: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps): up to 1024 columns, 8 columns (one 16-byte bf16 load) per thread."""
    block_n = min(MAX_BLOCK_N, triton.next_power_of_2(num_cols))
    return block_n, max(1, block_n // 256)


@triton.jit
def silu_mul(gate, up, DTYPE: tl.constexpr):
    """fp32 silu(gate) * up with torch's roundings for DTYPE inputs: torch's silu formula,
    x / (1 + exp(-x)), rounded to DTYPE like F.silu's output; the product is the caller's to
    round. Shared with the GEMV's gate|up epilogue, so both give the same bits."""
    act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    return act * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    rows_inner,
    stride_x_outer,
    stride_x_inner,
    inter,
    TWO_LEVEL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)  # before the first global load or store
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < inter
    x_row = x_ptr + _row_start(row, rows_inner, stride_x_outer, stride_x_inner, TWO_LEVEL)
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = silu_mul(gate, up, x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * inter + cols, act.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sigmoid_mul_kernel(
    x_ptr,
    gate_ptr,
    out_ptr,
    num_rows,
    rows_inner,
    stride_x_outer,
    stride_x_inner,
    stride_g_outer,
    stride_g_inner,
    num_cols,
    GATE_PER_ROW: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)  # before the first global load or store
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if ROWS == 1:
        row = tl.program_id(0).to(tl.int64)
        mask = cols < num_cols
        x_start = _row_start(row, rows_inner, stride_x_outer, stride_x_inner, TWO_LEVEL)
        g_start = _row_start(row, rows_inner, stride_g_outer, stride_g_inner, TWO_LEVEL)
        x_offsets = x_start + cols
        g_offsets = g_start if GATE_PER_ROW else g_start + cols
        out_offsets = row * num_cols + cols
    else:
        # ROWS short rows per program (prefill: e.g. the attention gate, T * H rows of head_dim)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
        x_start = _row_start(rows, rows_inner, stride_x_outer, stride_x_inner, TWO_LEVEL)
        g_start = _row_start(rows, rows_inner, stride_g_outer, stride_g_inner, TWO_LEVEL)
        x_offsets = x_start[:, None] + cols[None, :]
        g_offsets = g_start[:, None] if GATE_PER_ROW else g_start[:, None] + cols[None, :]
        out_offsets = rows[:, None] * num_cols + cols[None, :]
    x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0).to(tl.float32)
    if GATE_PER_ROW and ROWS == 1:  # [..., 1] gate: one scalar for the whole row
        gate = tl.load(gate_ptr + g_offsets).to(tl.float32)
    elif GATE_PER_ROW:
        gate = tl.load(gate_ptr + g_offsets, mask=rows[:, None] < num_rows, other=0.0).to(tl.float32)
    else:
        gate = tl.load(gate_ptr + g_offsets, mask=mask, other=0.0).to(tl.float32)
    scale = tl.sigmoid(gate).to(gate_ptr.dtype.element_ty).to(tl.float32)  # torch.sigmoid's output dtype
    tl.store(out_ptr + out_offsets, (x * scale).to(out_ptr.dtype.element_ty), mask=mask)


@fast_version(ref.silu_and_mul)
def silu_and_mul(x, *, block_n: int | None = None, num_warps: int | None = None):
    """x [..., 2I] (gate | up, rows may be strided) -> [..., I] contiguous."""
    if x.shape[-1] % 2:
        raise ValueError(f"x's last dim must be gate | up, got an odd {x.shape[-1]}")
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    (x,), (num_rows, rows_inner, ((sxo, sxi),)) = strided_rows(x.shape[:-1], x)
    if num_rows == 0 or inter == 0:
        return out
    default_block, default_warps = block_config(inter)
    block_n = block_n or default_block
    use_pdl = pdl_enabled(x)
    _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block_n))](
        x,
        out,
        rows_inner,
        sxo,
        sxi,
        inter,
        TWO_LEVEL=rows_inner > 1,
        BLOCK_N=block_n,
        USE_PDL=use_pdl,
        num_warps=num_warps or default_warps,
        launch_pdl=use_pdl,
    )
    return out


@fast_version(ref.sigmoid_mul)
def sigmoid_mul(x, gate, *, block_n: int | None = None, num_warps: int | None = None):
    """Same contract as ref.sigmoid_mul for gate of x's shape or x.shape[:-1] + (1,); rows may be strided."""
    num_cols = x.shape[-1]
    gate_per_row = gate.shape[-1] == 1 and num_cols != 1
    if gate.shape[:-1] != x.shape[:-1] or not (gate_per_row or gate.shape == x.shape):
        raise ValueError(f"gate {tuple(gate.shape)} must be x's shape {tuple(x.shape)} or that with a last dim of 1")
    out = torch.empty(x.shape, dtype=torch.result_type(x, gate), device=x.device)
    (x, gate), (num_rows, rows_inner, ((sxo, sxi), (sgo, sgi))) = strided_rows(x.shape[:-1], x, gate)
    if num_rows == 0 or num_cols == 0:
        return out
    default_block, default_warps = block_config(num_cols)
    block_n = block_n or default_block
    rows = rows_per_program(num_rows, block_n)
    use_pdl = pdl_enabled(x)
    _sigmoid_mul_kernel[(triton.cdiv(num_rows, rows), triton.cdiv(num_cols, block_n))](
        x,
        gate,
        out,
        num_rows,
        rows_inner,
        sxo,
        sxi,
        sgo,
        sgi,
        num_cols,
        GATE_PER_ROW=gate_per_row,
        TWO_LEVEL=rows_inner > 1,
        BLOCK_N=block_n,
        ROWS=rows,
        USE_PDL=use_pdl,
        num_warps=num_warps or (default_warps if rows == 1 else max(1, min(8, rows * block_n // 256))),
        launch_pdl=use_pdl,
    )
    return out
