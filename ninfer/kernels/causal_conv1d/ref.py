"""Depthwise causal conv1d + silu over a varlen batch, continuing from per-slot conv states.

The conv state of a request is the last kernel-1 *pre-conv* inputs it has seen (zeros for
a fresh sequence), so a chunk of any length, even shorter than kernel-1, continues exactly
where the previous chunk stopped. Computed in fp32, returned in x's dtype.
commit_conv_state advances the states of every layer over the speculative verification rows
a step accepted (the rows were convolved earlier without writing the state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_lens: tuple[int, ...],
    split: tuple[int, ...] | None = None,
    update_state: bool = True,
    *,
    out: torch.Tensor | None = None,
    inputs_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """x: [T, C] flat over requests; weight: [C, K]; conv_state: [num_slots, C, K-1] (updated in place
    unless update_state is False: speculative verification reads the state and commits later).

    Request b owns rows sum(query_lens[:b]) ... + query_lens[b] and state slot state_slots[b].
    Returns silu(conv(x)) [T, C]; with split (up to 3 channel counts), its column blocks as
    separate contiguous [T, c] matrices (the GDN's q, k, v, which the chunked kernels read
    contiguous).

    Speculative verification keeps its rows in a scratch (models/verify_scratch.py): out, a
    contiguous [T, C] matrix of x's dtype, receives the result (no split) and is returned;
    inputs_out, [T, C] of x's dtype with contiguous channels, receives a copy of x. With either,
    query_lens must cover x's T rows.
    """
    check_scratch_outputs(x, query_lens, split, out, inputs_out)
    if inputs_out is not None:
        inputs_out.copy_(x)
    if split is not None:
        if not 1 <= len(split) <= 3 or sum(split) != x.shape[1] or min(split) <= 0:
            raise ValueError(f"split {split} must be 1 to 3 positive channel counts summing to {x.shape[1]}")
        result = causal_conv1d(x, weight, conv_state, state_slots, query_lens, update_state=update_state)
        return tuple(part.contiguous() for part in result.split(list(split), dim=-1))
    state_len = conv_state.shape[-1]
    weight_f = weight.float()
    if out is None:
        out = torch.empty_like(x)
    slots = state_slots.tolist()
    start = 0
    for slot, query_len in zip(slots, query_lens):
        if query_len == 0:
            continue
        chunk = x[start : start + query_len].t().float()  # [C, L]
        window = torch.cat((conv_state[slot].float(), chunk), dim=-1)  # [C, K-1+L]
        # Depthwise conv without padding: the state supplies the causal left context.
        y = F.conv1d(window.unsqueeze(0), weight_f.unsqueeze(1), groups=window.shape[0])[0]  # [C, L]
        out[start : start + query_len] = F.silu(y).t().to(x.dtype)
        if update_state:
            conv_state[slot] = window[:, window.shape[-1] - state_len :].to(conv_state.dtype)
        start += query_len
    return out


def check_scratch_outputs(
    x: torch.Tensor,
    query_lens: tuple[int, ...],
    split: tuple[int, ...] | None,
    out: torch.Tensor | None,
    inputs_out: torch.Tensor | None,
) -> None:
    """The contract of causal_conv1d's out and inputs_out, shared with the fast version."""
    if out is None and inputs_out is None:
        return
    if sum(query_lens) != x.shape[0]:
        raise ValueError(f"query_lens {tuple(query_lens)} do not cover the {x.shape[0]} rows of x")
    if out is not None:
        if split is not None:
            raise ValueError("out takes the whole [T, C] result: no split")
        if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {tuple(x.shape)} {x.dtype} matrix")
    if inputs_out is not None:
        if inputs_out.shape != x.shape or inputs_out.dtype != x.dtype or inputs_out.stride(-1) != 1:
            raise ValueError(f"inputs_out must be {tuple(x.shape)} {x.dtype} with contiguous channels")


def causal_conv1d_padded(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    starts: torch.Tensor,
    max_query_len: int,
    split: tuple[int, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """causal_conv1d with the rows given on the device (a step padded to a captured graph's shape,
    models/padded_step.py): request b owns rows [starts[b], starts[b + 1]) (int32), at most
    max_query_len of them; an empty request leaves its slot alone. Rows of no request are
    unspecified (here zero)."""
    bounds = starts.tolist()
    out = torch.zeros_like(x)
    for b, slot in enumerate(state_slots.tolist()):
        lo, hi = bounds[b], bounds[b + 1]
        if hi - lo > max_query_len:
            raise ValueError(f"request {b} has {hi - lo} rows, more than the bound {max_query_len}")
        if hi > lo:
            one = torch.tensor([slot], dtype=torch.int64, device=state_slots.device)
            out[lo:hi] = causal_conv1d(x[lo:hi], weight, conv_state, one, (hi - lo,))
    if split is None:
        return out
    return tuple(part.contiguous() for part in out.split(list(split), dim=-1))


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor
) -> torch.Tensor:
    """Decode form, one new token per request: x: [B, C] -> silu(conv) [B, C]; conv_state updated in place."""
    window = torch.cat((conv_state[state_slots].float(), x.float().unsqueeze(-1)), dim=-1)  # [B, C, K]
    y = (window * weight.float().unsqueeze(0)).sum(-1)
    conv_state[state_slots] = window[..., 1:].to(conv_state.dtype)
    return F.silu(y).to(x.dtype)


def commit_conv_state(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    row_starts: torch.Tensor,
    counts: torch.Tensor,
    max_count: int,
) -> None:
    """Advance every layer's conv state slots over the accepted verification rows.

    x: [L, R, C] pre-conv inputs per row; conv_state: [L, num_slots, C, K-1], updated in place:
    state[:, state_slots[b]] becomes the last K-1 columns of [old state | rows row_starts[b] ...
    + counts[b] - 1], what causal_conv1d over those rows leaves (a copy: exact). counts[b] == 0
    leaves the slot as it was. row_starts and counts may live on the device; max_count bounds counts.
    """
    state_len = conv_state.shape[-1]
    slots = state_slots.tolist()
    pairs = list(zip(row_starts.tolist(), counts.tolist()))
    for start, count in pairs:  # all checked before any slot is written
        if not 0 <= count <= max_count or start < 0 or start + count > x.shape[1]:
            raise ValueError(f"rows {start}..{start + count} (bound {max_count}) outside the {x.shape[1]} rows")
    for slot, (start, count) in zip(slots, pairs):
        if count == 0:
            continue
        window = torch.cat((conv_state[:, slot], x[:, start : start + count].transpose(1, 2).to(conv_state.dtype)), -1)
        conv_state[:, slot] = window[..., window.shape[-1] - state_len :]
