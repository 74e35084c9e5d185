"""RMSNorm, residual-add + RMSNorm and gated RMSNorm in Triton: one launch, one program per row.

The torch references launch ~8 small kernels per norm (cast, pow, mean, add, rsqrt, mul,
cast, mul); at batch-1 decode each is a whole launch, graph-replayed or not, for a few KiB.
Here each program loads its whole row (D <= MAX_DIM, one power-of-two block), reduces the
sum of squares in fp32 and writes the result: one read of every input, one write of every
output.

The roundings are the references', step by step, because in bf16 they change results:
Llama style rounds normalize(x) to x's dtype before the multiply by w (a second rounding);
zero-centred (Qwen3.5) multiplies by (1 + w) in fp32 and rounds once. Products of two
bf16/fp16 values are exact in fp32, so "multiply in fp32, round once" equals torch's
multiply in the narrow dtype.

Rows: x is [..., D] with a unit last-dim stride; its leading dims are folded into at most
two levels (outer, inner) of rows, each with its own stride, so per-head views such as q
[T, H, D] sliced out of a packed projection are read in place. Outputs are new contiguous
tensors. Launch configuration depends only on shapes and dtypes: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.backend import fast_version
from ninfer.kernels.pdl import pdl_enabled, pdl_sync
from ninfer.kernels.rms_norm import ref

MAX_DIM = 16384


def num_warps_for(block_d: int) -> int:
    # 16 elements (two 16-byte bf16 loads) per thread: 1 warp for D <= 512, 16 warps at 5120/8192.
    return max(1, min(16, block_d // 512))


@triton.jit
def _row_start(row, rows_inner, stride_outer, stride_inner, TWO_LEVEL: tl.constexpr):
    """Element offset of row `row` in a tensor whose rows are (row // rows_inner, row % rows_inner)."""
    if TWO_LEVEL:
        return (row // rows_inner) * stride_outer + (row % rows_inner) * stride_inner
    else:
        return row * stride_outer


@triton.jit
def _normalize(x, dim, eps):
    """x * rsqrt(mean(x^2) + eps) in fp32; masked lanes of x are 0 and stay 0."""
    mean_square = tl.sum(x * x, axis=0) / dim
    return x * tl.math.rsqrt(mean_square + eps)


@triton.jit
def _load_weight(w_ptr, cols, mask):
    """The norm weight in fp32. Callers load it before pdl_sync: no kernel of a step writes
    it, so its read (from HBM: a decode step streams GBs of weights between two uses) overlaps
    the previous kernel instead of following the row's reduction."""
    return tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _scale(normed, w, x_dtype: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """The weighted row in fp32, before the caller's final rounding (see the module docstring)."""
    if ZERO_CENTERED:
        return normed * (1.0 + w)
    else:
        return normed.to(x_dtype).to(tl.float32) * w


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rows_inner,
    stride_x_outer,
    stride_x_inner,
    dim,
    eps,
    ZERO_CENTERED: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    w = _load_weight(w_ptr, cols, mask)
    pdl_sync(USE_PDL)  # x may be the previous kernel's output
    x_start = _row_start(row, rows_inner, stride_x_outer, stride_x_inner, TWO_LEVEL)
    x = tl.load(x_ptr + x_start + cols, mask=mask, other=0.0).to(tl.float32)
    y = _scale(_normalize(x, dim, eps), w, x_ptr.dtype.element_ty, ZERO_CENTERED)
    tl.store(out_ptr + row * dim + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    rows_inner,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    dim,
    eps,
    ZERO_CENTERED: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EARLY_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """EARLY_RESIDUAL: the residual is loaded before pdl_sync (the caller guarantees that the
    launch just before this one does not write it: see add_rms_norm)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    w = _load_weight(w_ptr, cols, mask)
    r_start = _row_start(row, rows_inner, stride_r_outer, stride_r_inner, TWO_LEVEL)
    if EARLY_RESIDUAL:
        residual = tl.load(res_ptr + r_start + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_sync(USE_PDL)  # x (and the residual) may be earlier kernels' outputs
    if not EARLY_RESIDUAL:
        residual = tl.load(res_ptr + r_start + cols, mask=mask, other=0.0).to(tl.float32)
    x_start = _row_start(row, rows_inner, stride_x_outer, stride_x_inner, TWO_LEVEL)
    x = tl.load(x_ptr + x_start + cols, mask=mask, other=0.0).to(tl.float32)
    # torch adds bf16/fp16 in fp32 and rounds once; the norm reads the rounded sum.
    summed = (x + residual).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * dim + cols, summed, mask=mask)
    y = _scale(_normalize(summed.to(tl.float32), dim, eps), w, sum_ptr.dtype.element_ty, ZERO_CENTERED)
    tl.store(out_ptr + row * dim + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    gate_ptr,
    w_ptr,
    out_ptr,
    num_rows,
    rows_inner,
    stride_x_outer,
    stride_x_inner,
    stride_g_outer,
    stride_g_inner,
    dim,
    eps,
    ROUND_WEIGHTED: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    EARLY_GATE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """EARLY_GATE (one row per program): the gate is loaded before pdl_sync (the caller
    guarantees that the launch just before this one does not write it: see gated_rms_norm)."""
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    w = _load_weight(w_ptr, cols, mask)
    if ROWS == 1:
        row = tl.program_id(0).to(tl.int64)
        g_start = _row_start(row, rows_inner, stride_g_outer, stride_g_inner, TWO_LEVEL)
        if EARLY_GATE:
            gate = tl.load(gate_ptr + g_start + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_sync(USE_PDL)  # x (and the gate) are earlier kernels' outputs
    if ROWS == 1:
        if not EARLY_GATE:
            gate = tl.load(gate_ptr + g_start + cols, mask=mask, other=0.0).to(tl.float32)
        x_start = _row_start(row, rows_inner, stride_x_outer, stride_x_inner, TWO_LEVEL)
        x = tl.load(x_ptr + x_start + cols, mask=mask, other=0.0).to(tl.float32)
        weighted = _scale(_normalize(x, dim, eps), w, x_ptr.dtype.element_ty, False)
        out_ptrs = out_ptr + row * dim + cols
        out_mask = mask
    else:
        # ROWS short rows per program (prefill: thousands of 128-wide head rows), one tile.
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_mask = rows < num_rows
        out_mask = row_mask[:, None] & mask[None, :]
        x_start = _row_start(rows, rows_inner, stride_x_outer, stride_x_inner, TWO_LEVEL)
        g_start = _row_start(rows, rows_inner, stride_g_outer, stride_g_inner, TWO_LEVEL)
        x = tl.load(x_ptr + x_start[:, None] + cols[None, :], mask=out_mask, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptr + g_start[:, None] + cols[None, :], mask=out_mask, other=0.0).to(tl.float32)
        normed = x * tl.math.rsqrt(tl.sum(x * x, axis=1) / dim + eps)[:, None]
        weighted = _scale(normed, w, x_ptr.dtype.element_ty, False)  # w broadcasts over rows
        out_ptrs = out_ptr + rows[:, None] * dim + cols[None, :]
    if ROUND_WEIGHTED:  # ref's `weight * normed.to(dtype)` is in x's dtype unless w is wider
        weighted = weighted.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = weighted * (gate * tl.sigmoid(gate))
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


MANY_ROWS = 4096  # from here on short rows share a program (prefill); decode keeps one row each
ROW_TILE_ELEMENTS = 4096


def rows_per_program(num_rows: int, block: int) -> int:
    """1 for decode-sized launches; for many short rows, as many as fill ROW_TILE_ELEMENTS."""
    if num_rows < MANY_ROWS:
        return 1
    return max(1, min(64, ROW_TILE_ELEMENTS // block))


def row_layout(leading_shape: torch.Size, *tensors: torch.Tensor) -> tuple[int, int, list[tuple[int, int]]] | None:
    """Fold the leading dims shared by `tensors` into (outer, inner) rows.

    Returns (num_rows, rows_inner, [(stride_outer, stride_inner) per tensor]), rows_inner 1
    when one level suffices, or None when the strides need more than two levels. Dims are
    merged only where every tensor allows it, so row r is the same logical row in all.
    """
    num_rows = 1
    groups: list[tuple[int, list[int]]] = []  # (size, stride per tensor), innermost first
    for i in reversed(range(len(leading_shape))):
        size = leading_shape[i]
        num_rows *= size
        if size == 1:
            continue
        strides = [t.stride(i) for t in tensors]
        if groups and all(s == gs * groups[-1][0] for s, gs in zip(strides, groups[-1][1])):
            groups[-1] = (groups[-1][0] * size, groups[-1][1])
        else:
            groups.append((size, strides))
    if len(groups) > 2:
        return None
    if len(groups) < 2:
        outer = groups[0][1] if groups else [0] * len(tensors)
        return num_rows, 1, [(s, 0) for s in outer]
    (inner_size, inner), (_, outer) = groups
    return num_rows, inner_size, list(zip(outer, inner))


def strided_rows(leading_shape: torch.Size, *tensors: torch.Tensor):
    """row_layout, after copying whatever the kernels cannot index in place (a last-dim stride
    other than 1 on a dim longer than 1, or more than two row levels) to contiguous."""
    tensors = tuple(t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous() for t in tensors)
    layout = row_layout(leading_shape, *tensors)
    if layout is None:
        tensors = tuple(t.contiguous() for t in tensors)
        layout = row_layout(leading_shape, *tensors)
    return tensors, layout


def _check(x: torch.Tensor, weight: torch.Tensor) -> int:
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")
    if dim > MAX_DIM:
        raise ValueError(f"one program per row holds at most {MAX_DIM} elements, got {dim}")
    return dim


@fast_version(ref.rms_norm)
def rms_norm(x, weight, eps, zero_centered=False, *, num_warps: int | None = None):
    """x [..., D] may be a strided view. Returns a contiguous tensor."""
    dim = _check(x, weight)
    out_dtype = x.dtype if zero_centered else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    (x,), (num_rows, rows_inner, ((sxo, sxi),)) = strided_rows(x.shape[:-1], x)
    if num_rows == 0 or dim == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    use_pdl = pdl_enabled(x)
    _rms_norm_kernel[(num_rows,)](
        x,
        weight.contiguous(),
        out,
        rows_inner,
        sxo,
        sxi,
        dim,
        eps,
        ZERO_CENTERED=zero_centered,
        TWO_LEVEL=rows_inner > 1,
        BLOCK_D=block_d,
        USE_PDL=use_pdl,
        num_warps=num_warps or num_warps_for(block_d),
        launch_pdl=use_pdl,
    )
    return out


@fast_version(ref.add_rms_norm)
def add_rms_norm(x, residual, weight, eps, zero_centered=False, *, early_residual=False, num_warps: int | None = None):
    """Same contract as ref.add_rms_norm: (rms_norm(x + residual), x + residual), both contiguous.

    early_residual: read the residual before the PDL wait (ninfer.kernels.pdl), so its HBM
    latency overlaps the previous kernel. Only when the launch just before this one cannot
    be writing it: a pre-norm layer's residual is an earlier norm's sum, with a GEMV between.
    """
    dim = _check(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
    sum_dtype = torch.result_type(x, residual)
    out_dtype = sum_dtype if zero_centered else torch.promote_types(weight.dtype, sum_dtype)
    summed = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    (x, residual), (num_rows, rows_inner, ((sxo, sxi), (sro, sri))) = strided_rows(x.shape[:-1], x, residual)
    if num_rows == 0 or dim == 0:
        return out, summed
    block_d = triton.next_power_of_2(dim)
    use_pdl = pdl_enabled(x)
    _add_rms_norm_kernel[(num_rows,)](
        x,
        residual,
        weight.contiguous(),
        out,
        summed,
        rows_inner,
        sxo,
        sxi,
        sro,
        sri,
        dim,
        eps,
        ZERO_CENTERED=zero_centered,
        TWO_LEVEL=rows_inner > 1,
        BLOCK_D=block_d,
        EARLY_RESIDUAL=early_residual and use_pdl,
        USE_PDL=use_pdl,
        num_warps=num_warps or num_warps_for(block_d),
        launch_pdl=use_pdl,
    )
    return out, summed


@fast_version(ref.gated_rms_norm)
def gated_rms_norm(x, gate, weight, eps, *, early_gate=False, num_warps: int | None = None):
    """x and gate [..., D] (either a strided view). Returns x's dtype.

    early_gate: read the gate before the PDL wait (decode-sized launches), as add_rms_norm's
    early_residual: only when the launch just before this one cannot be writing it.
    """
    dim = _check(x, weight)
    if gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and x {tuple(x.shape)} differ")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    (x, gate), (num_rows, rows_inner, ((sxo, sxi), (sgo, sgi))) = strided_rows(x.shape[:-1], x, gate)
    if num_rows == 0 or dim == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    rows = rows_per_program(num_rows, block_d)
    use_pdl = pdl_enabled(x)
    _gated_rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x,
        gate,
        weight.contiguous(),
        out,
        num_rows,
        rows_inner,
        sxo,
        sxi,
        sgo,
        sgi,
        dim,
        eps,
        ROUND_WEIGHTED=torch.promote_types(weight.dtype, x.dtype) == x.dtype,
        TWO_LEVEL=rows_inner > 1,
        BLOCK_D=block_d,
        ROWS=rows,
        EARLY_GATE=early_gate and use_pdl and rows == 1,
        USE_PDL=use_pdl,
        num_warps=num_warps or num_warps_for(rows * block_d),
        launch_pdl=use_pdl,
    )
    return out
