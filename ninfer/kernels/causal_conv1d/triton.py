"""Depthwise causal conv1d + silu in Triton, reading and writing the per-slot conv states in place.

Decode update: one program per (request, channel block). Each thread owns whole channels:
it loads the K-1 state columns of its channels and the new input, and writes the state
shifted by one, so every state element is loaded and stored by the same thread and no
barrier is needed. Only the slot ids are read from per-step memory: capture-safe.

Varlen prefill: one program per (request, channel block, BLOCK_T tokens). The output tile
[BLOCK_T, BLOCK_C] is the sum of K shifted input tiles, each element taken from the chunk
(position >= 0) or from the slot's state (position < 0, the last K-1 inputs seen before).
Only the token-block-0 program of a request reads the old state (BLOCK_T >= K-1), and that
same program writes the new state (the request's last K-1 inputs, which come from the old
state too when the chunk is shorter than K-1) after a barrier, so no other program can see
a half-updated state. Computed in fp32; one rounding to x's dtype at the end.
Speculative verification rows (update_state=False) go straight to the caller's scratch: the
output into its out matrix, and each program's own input tile (the last tap's) into
inputs_out, so every input row is stored once and the scratch needs no copy launches.

Commit of speculative verification rows (commit_conv_state): the state shift alone, over each
request's accepted rows, for every layer in one launch; the counts are loaded by the kernel,
so the launch is capture-safe and needs no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.backend import fast_version
from ninfer.kernels.causal_conv1d import ref
from ninfer.kernels.causal_conv1d.ref import check_scratch_outputs
from ninfer.kernels.pdl import pdl_enabled, pdl_sync
from ninfer.kernels.varlen import start_offsets

BLOCK_C_DECODE = 256
# [16, 256] tiles over 8 warps: 128 registers, 16-byte loads of x, no spills (sm_90 build);
# [32, 128] over 4 warps needed 255 registers and spilled.
BLOCK_C_PREFILL = 256
BLOCK_T_PREFILL = 16
PREFILL_WARPS = 8


@triton.jit
def _conv_update_kernel(
    x_ptr,
    weight_ptr,
    state_ptr,
    slots_ptr,
    out_ptr,
    stride_xt,
    stride_ot,
    stride_wc,
    stride_slot,
    stride_sc,
    num_channels,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    STATE_COLS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    i_b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = c < num_channels
    # Before the wait (see ninfer.kernels.pdl): the slot, the weights and the state, which
    # only this kernel writes (one step earlier); x is the previous kernel's output.
    slot = tl.load(slots_ptr + i_b).to(tl.int64)
    p_state = state_ptr + slot * stride_slot + c * stride_sc
    j = tl.arange(0, STATE_COLS)
    tile_mask = mask[:, None] & (j < K - 1)[None, :]
    state = tl.load(p_state[:, None] + j[None, :], mask=tile_mask, other=0.0).to(tl.float32)
    w_old = tl.load(weight_ptr + c[:, None] * stride_wc + j[None, :], mask=tile_mask, other=0.0).to(tl.float32)
    w_new = tl.load(weight_ptr + c * stride_wc + (K - 1), mask=mask, other=0.0).to(tl.float32)
    pdl_sync(USE_PDL)
    x_new = tl.load(x_ptr + i_b * stride_xt + c, mask=mask, other=0.0)
    acc = x_new.to(tl.float32) * w_new
    # State column m holds the input K-1-m steps back; after this token it moves to m-1.
    for m in tl.static_range(K - 1):
        s_m = tl.sum(tl.where(j[None, :] == m, state, 0.0), axis=1)  # column m, exactly
        acc += s_m * tl.sum(tl.where(j[None, :] == m, w_old, 0.0), axis=1)
        if m > 0:
            tl.store(p_state + (m - 1), s_m.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(p_state + (K - 2), x_new.to(state_ptr.dtype.element_ty), mask=mask)
    y = acc * tl.sigmoid(acc)
    tl.store(out_ptr + i_b * stride_ot + c, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_part(out_ptr, y, rows, c, part_start, width, part_offset, mask):
    """y's columns c in [part_start, part_start + width) into that part's [num_tokens, width]
    matrix at part_offset elements. All three are kernel arguments, so Triton knows when they
    are multiples of 16 and keeps the stores vectorized."""
    in_part = (c >= part_start) & (c < part_start + width)
    tl.store(out_ptr + part_offset + rows * width + (c - part_start)[None, :], y, mask=mask & in_part[None, :])


@triton.jit
def _conv_varlen_kernel(
    x_ptr,
    weight_ptr,
    state_ptr,
    slots_ptr,
    cu_seqlens_ptr,
    out_ptr,
    inputs_ptr,
    stride_xt,
    stride_it,
    stride_wc,
    stride_slot,
    stride_sc,
    num_channels,
    split1,
    split2,
    width0,
    width1,
    width2,
    offset1,
    offset2,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    STATE_COLS: tl.constexpr,
    WRITE_STATE: tl.constexpr,
    WRITE_INPUTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)  # before the first global load or store
    i_r = tl.program_id(0)
    i_c = tl.program_id(1)
    i_t = tl.program_id(2)
    bos = tl.load(cu_seqlens_ptr + i_r).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + i_r + 1).to(tl.int64) - bos
    t0 = i_t * BLOCK_T
    if t0 < length:
        slot = tl.load(slots_ptr + i_r).to(tl.int64)
        c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_c = c < num_channels
        t = t0 + tl.arange(0, BLOCK_T)  # positions within the request
        mask_t = t < length
        p_state = state_ptr + slot * stride_slot + c * stride_sc

        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for w in tl.static_range(K):
            pos = t + (w - (K - 1))  # input position feeding tap w
            in_chunk = (pos >= 0) & mask_t
            in_state = (pos < 0) & mask_t
            from_x = tl.load(
                x_ptr + (bos + pos)[:, None] * stride_xt + c[None, :],
                mask=in_chunk[:, None] & mask_c[None, :],
                other=0.0,
            )
            from_state = tl.load(
                p_state[None, :] + (pos + (K - 1))[:, None],
                mask=in_state[:, None] & mask_c[None, :],
                other=0.0,
            )
            if WRITE_INPUTS and w == K - 1:
                # The last tap reads exactly this program's own rows: each input row is stored
                # once, by the program that computes its output (speculative verification keeps them).
                tl.store(
                    inputs_ptr + (bos + t)[:, None] * stride_it + c[None, :],
                    from_x,
                    mask=mask_t[:, None] & mask_c[None, :],
                )
            tap = tl.load(weight_ptr + c * stride_wc + w, mask=mask_c, other=0.0).to(tl.float32)
            acc += (from_x.to(tl.float32) + from_state.to(tl.float32)) * tap[None, :]
        y = acc * tl.sigmoid(acc)
        # Output parts [0, split1), [split1, split2), [split2, C) are stored one after another,
        # each a contiguous [num_tokens, width] matrix (one part when split1 = split2 = C). One
        # store per part this channel block overlaps, with that part's scalar start and width,
        # so the addresses stay contiguous along the channels (16-byte stores).
        y = y.to(out_ptr.dtype.element_ty)
        rows = (bos + t)[:, None]
        c_first = i_c * BLOCK_C
        c_last = tl.minimum(c_first + BLOCK_C, num_channels) - 1
        mask = mask_t[:, None] & mask_c[None, :]
        if c_first < split1:
            _store_part(out_ptr, y, rows, c, 0, width0, 0, mask)
        if (c_last >= split1) & (c_first < split2):
            _store_part(out_ptr, y, rows, c, split1, width1, offset1, mask)
        if c_last >= split2:
            _store_part(out_ptr, y, rows, c, split2, width2, offset2, mask)

        if WRITE_STATE and i_t == 0:
            # New state column j = input at position length-(K-1)+j, from the old state if < 0.
            j = tl.arange(0, STATE_COLS)
            pos_j = length - (K - 1) + j
            live = mask_c[:, None] & (j < K - 1)[None, :]
            col_x = tl.load(
                x_ptr + (bos + pos_j)[None, :] * stride_xt + c[:, None], mask=live & (pos_j >= 0)[None, :], other=0.0
            )
            col_s = tl.load(p_state[:, None] + (pos_j + (K - 1))[None, :], mask=live & (pos_j < 0)[None, :], other=0.0)
            new_state = col_x.to(state_ptr.dtype.element_ty) + col_s
            # Every read of the old state above (by any thread of this program) precedes the writes.
            tl.debug_barrier()
            tl.store(p_state[:, None] + j[None, :], new_state, mask=live)


def _check(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> None:
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight need contiguous channels/taps")
    if conv_state.stride(-1) != 1:
        raise ValueError("conv_state columns must be contiguous")
    if weight.shape[-1] != conv_state.shape[-1] + 1:
        raise ValueError(f"kernel {weight.shape[-1]} needs a state of {weight.shape[-1] - 1} columns")


def split_widths(num_channels: int, split: tuple[int, ...] | None) -> tuple[int, ...]:
    """The output parts' channel counts (up to 3, summing to num_channels); one part without a split."""
    if split is None:
        return (num_channels,)
    if not 1 <= len(split) <= 3 or sum(split) != num_channels or min(split) <= 0:
        raise ValueError(f"split {split} must be 1 to 3 positive channel counts summing to {num_channels}")
    return tuple(split)


@fast_version(ref.causal_conv1d_update)
def causal_conv1d_update(x, weight, conv_state, state_slots):
    """Capture-safe."""
    _check(x, weight, conv_state)
    num_requests, num_channels = x.shape
    out = torch.empty((num_requests, num_channels), dtype=x.dtype, device=x.device)
    if num_requests == 0:
        return out
    grid = (num_requests, triton.cdiv(num_channels, BLOCK_C_DECODE))
    use_pdl = pdl_enabled(x)
    _conv_update_kernel[grid](
        x,
        weight,
        conv_state,
        state_slots,
        out,
        x.stride(0),
        out.stride(0),
        weight.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        num_channels,
        K=weight.shape[-1],
        BLOCK_C=BLOCK_C_DECODE,
        STATE_COLS=triton.next_power_of_2(weight.shape[-1] - 1),
        USE_PDL=use_pdl,
        num_warps=4,
        launch_pdl=use_pdl,
    )
    return out


@fast_version(ref.causal_conv1d)
def causal_conv1d(
    x, weight, conv_state, state_slots, query_lens, split=None, update_state=True, *, out=None, inputs_out=None
):
    """Same contract as ref.causal_conv1d (varlen, slot states updated in place), split included:
    the parts are written straight into their own contiguous matrices (no copies); out and
    inputs_out are written by the kernel too, so verification rows need no copy launches."""
    check_scratch_outputs(x, query_lens, split, out, inputs_out)
    if x.shape[0] == 0 or not query_lens:
        return out if out is not None else _output_parts(x, split)[1]
    cu_seqlens = start_offsets(tuple(query_lens), x.device, torch.int32)
    num_requests, max_query_len = len(query_lens), max(query_lens)
    return _varlen(
        x, weight, conv_state, state_slots, cu_seqlens, num_requests, max_query_len, split, update_state, out,
        inputs_out,
    )  # fmt: skip


@fast_version(ref.causal_conv1d_padded)
def causal_conv1d_padded(x, weight, conv_state, state_slots, starts, max_query_len, split=None):
    """The varlen kernel over offsets read on the device
    and a grid from the bounds alone (token blocks past a request's rows exit): capture-safe."""
    num_requests = starts.shape[0] - 1
    return _varlen(x, weight, conv_state, state_slots, starts, num_requests, max_query_len, split, True)


def _output_parts(x: torch.Tensor, split: tuple[int, ...] | None, out: torch.Tensor | None = None):
    """-> (the flat buffer, bounds of its parts, the output: one [T, C] matrix or the split parts);
    a caller's out (contiguous [T, C], no split) is the buffer itself."""
    num_tokens, num_channels = x.shape
    if out is not None:
        return out.view(-1), [0, num_channels], out
    widths = split_widths(num_channels, split)
    buffer = torch.empty(num_tokens * num_channels, dtype=x.dtype, device=x.device)
    bounds = [0]
    for width in widths:
        bounds.append(bounds[-1] + width)
    parts = tuple(
        buffer[num_tokens * lo : num_tokens * hi].view(num_tokens, hi - lo) for lo, hi in zip(bounds, bounds[1:])
    )
    return buffer, bounds, parts if split is not None else parts[0]


def _varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_requests: int,
    max_query_len: int,
    split: tuple[int, ...] | None,
    update_state: bool,
    out: torch.Tensor | None = None,
    inputs_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The varlen kernel over requests' rows at cu_seqlens (int32 [num_requests + 1], on the device)."""
    _check(x, weight, conv_state)
    num_tokens, num_channels = x.shape
    buffer, bounds, out = _output_parts(x, split, out)
    kernel = weight.shape[-1]
    if num_tokens == 0 or num_requests == 0 or max_query_len == 0:
        return out
    if BLOCK_T_PREFILL < kernel - 1:
        raise ValueError("the first token block must cover the whole state")
    num_parts = len(bounds) - 1
    split1 = bounds[1] if num_parts > 1 else num_channels
    split2 = bounds[2] if num_parts > 2 else num_channels
    grid = (num_requests, triton.cdiv(num_channels, BLOCK_C_PREFILL), triton.cdiv(max_query_len, BLOCK_T_PREFILL))
    use_pdl = pdl_enabled(x)
    _conv_varlen_kernel[grid](
        x,
        weight,
        conv_state,
        state_slots,
        cu_seqlens,
        buffer,
        inputs_out if inputs_out is not None else x,  # unused placeholder without inputs_out
        x.stride(0),
        inputs_out.stride(0) if inputs_out is not None else 0,
        weight.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        num_channels,
        split1,
        split2,
        split1,
        split2 - split1,
        num_channels - split2,
        num_tokens * split1,  # element offsets of parts 1 and 2 in the buffer
        num_tokens * split2,
        K=kernel,
        BLOCK_T=BLOCK_T_PREFILL,
        BLOCK_C=BLOCK_C_PREFILL,
        STATE_COLS=triton.next_power_of_2(kernel - 1),
        WRITE_STATE=update_state,
        WRITE_INPUTS=inputs_out is not None,
        USE_PDL=use_pdl,
        num_warps=PREFILL_WARPS,
        launch_pdl=use_pdl,
    )
    return out


@triton.jit
def _commit_state_kernel(
    x_ptr,
    state_ptr,
    slots_ptr,
    starts_ptr,
    counts_ptr,
    stride_xl,
    stride_xt,
    stride_sl,
    stride_slot,
    stride_sc,
    num_channels,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per (request, layer, channel block). New column j is the input at row
    count-(K-1)+j, or old column count+j when that is < 0. Columns are written in increasing j and
    column j only reads old column count+j >= j, so updating in place needs no copy; every column
    is a 1-D vector over the channels, so each element is read and written by the same thread and
    no barrier is needed (as in the decode update)."""
    pdl_sync(USE_PDL)  # counts and starts come from the acceptance step just before
    i_b = tl.program_id(0)
    i_l = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    start = tl.load(starts_ptr + i_b).to(tl.int64)
    count = tl.load(counts_ptr + i_b).to(tl.int64)
    slot = tl.load(slots_ptr + i_b).to(tl.int64)
    mask = (c < num_channels) & (count > 0)  # an empty request leaves its slot alone
    p_state = state_ptr + i_l * stride_sl + slot * stride_slot + c * stride_sc
    p_x = x_ptr + i_l * stride_xl + start * stride_xt + c
    for j in tl.static_range(K - 1):
        pos = count - (K - 1) + j  # row within the request
        from_x = tl.load(p_x + pos * stride_xt, mask=mask & (pos >= 0), other=0.0)
        from_state = tl.load(p_state + (pos + (K - 1)), mask=mask & (pos < 0), other=0.0)
        column = tl.where(pos >= 0, from_x.to(state_ptr.dtype.element_ty), from_state)
        tl.store(p_state + j, column, mask=mask)


@fast_version(ref.commit_conv_state)
def commit_conv_state(x, conv_state, state_slots, row_starts, counts, max_count):
    """One launch for all layers and requests; capture-safe
    (starts, counts and slots are only read by the kernel; max_count is unused: no loop over rows)."""
    num_layers, _, num_channels, state_len = conv_state.shape
    if x.shape[0] != num_layers or x.shape[-1] != num_channels:
        raise ValueError(f"x {tuple(x.shape)} does not match conv_state {tuple(conv_state.shape)}")
    if x.stride(-1) != 1 or conv_state.stride(-1) != 1:
        raise ValueError("x channels and conv_state columns must be contiguous")
    num_requests = state_slots.shape[0]
    if num_requests == 0 or num_layers == 0 or max_count == 0 or state_len == 0:
        return
    grid = (num_requests, num_layers, triton.cdiv(num_channels, BLOCK_C_DECODE))
    use_pdl = pdl_enabled(x)
    _commit_state_kernel[grid](
        x,
        conv_state,
        state_slots,
        row_starts,
        counts,
        x.stride(0),
        x.stride(1),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        num_channels,
        K=state_len + 1,
        BLOCK_C=BLOCK_C_DECODE,
        USE_PDL=use_pdl,
        num_warps=4,
        launch_pdl=use_pdl,
    )
