"""Gated delta rule (Gated DeltaNet's linear attention) references, chunked and recurrent.

Per v-head h, with fp32 state S [dk, dv] and per-token log-decay g <= 0 and rate beta:
    S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t
q and k are l2-normalised inside the kernel (eps 1e-6 inside the rsqrt) and q is scaled by
dk^-0.5. Grouped value heads: v-head h reads q/k head h // (Hv / Hk). Every request starts
from its state slot (zeros = fresh sequence) and leaves its final state there.

gdn_gates turns the layer's per-head projections a, b into the rule's g and beta.
commit_gated_delta_rule advances the slots of every layer over the speculative verification
rows a step accepted (the rows were scored earlier without writing the state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
# Positions per chunk of the chunked form: the triangular solve is CHUNK_SIZE^2 per head.
CHUNK_SIZE = 64


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [T, Hv]; A_log, dt_bias: [Hv] -> (g, beta), fp32 [T, Hv].

    g = -exp(A_log) * softplus(a + dt_bias) (log-decay <= 0), beta = sigmoid(b). fp32
    throughout: exp(A_log) overflows half precision and g feeds an exp per token.
    """
    beta = torch.sigmoid(b.float())
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, beta


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, Hk, dk] -> fp32 [T, Hv, dk]: l2-normalised, q scaled, k/q heads shared by their v-head group."""
    q = q.float()
    k = k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    group = num_v_heads // q.shape[1]
    if group > 1:
        q = q.repeat_interleave(group, dim=1)
        k = k.repeat_interleave(group, dim=1)
    return q, k


def _recurrent_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q, k: [..., L, H, dk]; v: [..., L, H, dv]; g, beta: [..., L, H]; state [..., H, dk, dv]."""
    out = torch.empty_like(v)
    for t in range(v.shape[-3]):
        q_t, k_t, v_t = q[..., t, :, :], k[..., t, :, :], v[..., t, :, :]
        state = state * g[..., t, :].exp()[..., None, None]
        predicted = torch.einsum("...hkv,...hk->...hv", state, k_t)
        update = (v_t - predicted) * beta[..., t, :, None]
        state = state + k_t.unsqueeze(-1) * update.unsqueeze(-2)
        out[..., t, :, :] = torch.einsum("...hkv,...hk->...hv", state, q_t)
    return out, state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    query_lens: tuple[int, ...],
    update_state: bool = True,
) -> torch.Tensor:
    """Token-by-token form (decode, short verify rows).

    q, k: [T, Hk, dk]; v: [T, Hv, dv]; g, beta: [T, Hv]; state: [num_slots, Hv, dk, dv] fp32,
    updated in place at state_slots[b] (left as it was when update_state is False: speculative
    verification scores its rows and commits the accepted ones later). Returns o [T, Hv, dv] in
    v's dtype.
    """
    num_v_heads = v.shape[1]
    qf, kf = _prepare_qk(q, k, num_v_heads)
    vf, gf, betaf = v.float(), g.float(), beta.float()
    if query_lens and all(n == query_lens[0] for n in query_lens):
        # Equal lengths (every decode round): one scan over the whole batch.
        num_requests, query_len = len(query_lens), query_lens[0]
        out, final = _recurrent_scan(
            *(x.reshape(num_requests, query_len, *x.shape[1:]) for x in (qf, kf, vf, gf, betaf)),
            state[state_slots].float(),
        )
        if update_state:
            state[state_slots] = final.to(state.dtype)
        return out.reshape(v.shape).to(v.dtype)
    out = torch.empty_like(vf)
    start = 0
    for slot, query_len in zip(state_slots.tolist(), query_lens):
        rows = slice(start, start + query_len)
        out[rows], final = _recurrent_scan(qf[rows], kf[rows], vf[rows], gf[rows], betaf[rows], state[slot].float())
        if update_state:
            state[slot] = final.to(state.dtype)
        start += query_len
    return out.to(v.dtype)


def _chunked_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, fp32, head-major: q, k [H, L, dk]; v [H, L, dv]; g, beta [H, L]; state [H, dk, dv].

    Within a chunk (positions i, j; G = cumulative log-decay from the chunk start, S0 the state
    entering it) the written values u solve the unit lower-triangular system
        u_i + sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) u_j = beta_i (v_i - exp(G_i) S0^T k_i),
    after which outputs and the exit state are plain matmuls:
        o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j
        S   = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j u_j^T
    """
    out = torch.empty_like(v)
    length = v.shape[1]
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        q_c, k_c, v_c = q[:, start:end], k[:, start:end], v[:, start:end]
        beta_c = beta[:, start:end, None]
        cum = g[:, start:end].cumsum(-1)  # [H, C]
        size = end - start
        causal = torch.ones(size, size, dtype=torch.bool, device=v.device).tril()
        # exp(G_i - G_j) for j <= i; the masked entries would overflow, so mask before exp.
        pair_decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        system = (beta_c * (k_c @ k_c.transpose(-1, -2)) * pair_decay).tril(-1)
        system = system + torch.eye(size, dtype=v.dtype, device=v.device)
        # Solve for the two right-hand sides at once: values, and keys reading the entry state.
        rhs = torch.cat((beta_c * v_c, beta_c * cum.exp()[..., None] * k_c), dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u_from_values, u_per_state = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
        u = u_from_values - u_per_state @ state  # [H, C, dv]
        scores = (q_c @ k_c.transpose(-1, -2)) * pair_decay
        out[:, start:end] = (q_c * cum.exp()[..., None]) @ state + scores @ u
        tail_decay = (cum[:, -1:] - cum).exp()[..., None]  # exp(G_last - G_j)
        state = state * cum[:, -1].exp()[:, None, None] + (k_c * tail_decay).transpose(-1, -2) @ u
    return out, state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    query_lens: tuple[int, ...],
) -> torch.Tensor:
    """Chunked form (prefill chunks); same arguments and result as recurrent_gated_delta_rule."""
    num_v_heads = v.shape[1]
    qf, kf = _prepare_qk(q, k, num_v_heads)
    vf, gf, betaf = v.float(), g.float(), beta.float()
    out = torch.empty_like(vf)
    start = 0
    for slot, query_len in zip(state_slots.tolist(), query_lens):
        rows = slice(start, start + query_len)
        o, final = _chunked_scan(
            qf[rows].transpose(0, 1),
            kf[rows].transpose(0, 1),
            vf[rows].transpose(0, 1),
            gf[rows].t(),
            betaf[rows].t(),
            state[slot].float(),
            CHUNK_SIZE,
        )
        out[rows] = o.transpose(0, 1)
        state[slot] = final.to(state.dtype)
        start += query_len
    return out.to(v.dtype)


def chunk_gated_delta_rule_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    starts: torch.Tensor,
    chunk_indices: torch.Tensor,
    chunk_offsets: torch.Tensor,
) -> torch.Tensor:
    """chunk_gated_delta_rule with the rows given on the device (a step padded to a captured
    graph's shape, models/padded_step.py): request b owns rows [starts[b], starts[b + 1]); an
    empty request leaves its slot alone. chunk_indices / chunk_offsets list the requests' chunks
    as the fast version reads them (the reference checks them). Rows of no request are
    unspecified (here zero)."""
    bounds = starts.tolist()
    lengths = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    chunks = [[b, c] for b, n in enumerate(lengths) for c in range(-(-n // CHUNK_SIZE))]
    listed = chunk_indices.tolist()
    if listed[: len(chunks)] != chunks or any(b != len(lengths) - 1 or lengths[b] for b, _ in listed[len(chunks) :]):
        raise ValueError("chunk_indices do not list the requests' chunks, padded with the empty last request")
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + -(-n // CHUNK_SIZE))
    if chunk_offsets.tolist() != offsets:
        raise ValueError(f"chunk_offsets {chunk_offsets.tolist()} are not the requests' chunk counts {offsets}")
    out = torch.zeros_like(v)
    for b, slot in enumerate(state_slots.tolist()):
        lo, hi = bounds[b], bounds[b + 1]
        if hi > lo:
            one = torch.tensor([slot], dtype=torch.int64, device=state_slots.device)
            rows = slice(lo, hi)
            out[rows] = chunk_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], state, one, (hi - lo,))
    return out


def gather_state_rows(state: torch.Tensor, state_slots: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """-> [R, ...] fp32: row b holds state[state_slots[b]] where request b has rows (starts[b] <
    starts[b + 1]); the rows of empty requests are unspecified (here zero), never read back."""
    out = torch.zeros((state_slots.shape[0], *state.shape[1:]), dtype=torch.float32, device=state.device)
    live = (starts[1:] > starts[:-1]).nonzero().flatten()
    out[live] = state.index_select(0, state_slots[live]).float()
    return out


def scatter_state_rows(state: torch.Tensor, state_slots: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor) -> None:
    """state[state_slots[b]] = rows[b] for the requests with rows; empty requests' slots untouched."""
    live = (starts[1:] > starts[:-1]).nonzero().flatten()
    state.index_copy_(0, state_slots[live], rows[live].to(state.dtype))


def recurrent_gated_delta_rule_with_gates(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    query_lens: tuple[int, ...],
    update_state: bool = True,
    *,
    gates_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """recurrent_gated_delta_rule with the gates given as the projections a, b (see gdn_gates).

    gates_out, [T, 2*Hv] of a's dtype with contiguous heads, receives a copy of a then b (the
    raw gates speculative verification keeps, models/verify_scratch.py); query_lens must then
    cover a's T rows.
    """
    check_gates_out(a, b, query_lens, gates_out)
    if gates_out is not None:
        num_v_heads = a.shape[1]
        gates_out[:, :num_v_heads].copy_(a)
        gates_out[:, num_v_heads:].copy_(b)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    return recurrent_gated_delta_rule(q, k, v, g, beta, state, state_slots, query_lens, update_state)


def check_gates_out(
    a: torch.Tensor, b: torch.Tensor, query_lens: tuple[int, ...], gates_out: torch.Tensor | None
) -> None:
    """The contract of recurrent_gated_delta_rule_with_gates' gates_out, shared with the fast version."""
    if gates_out is None:
        return
    num_tokens, num_v_heads = a.shape
    if sum(query_lens) != num_tokens:
        raise ValueError(f"query_lens {tuple(query_lens)} do not cover the {num_tokens} rows of a and b")
    if b.dtype != a.dtype or gates_out.dtype != a.dtype:
        raise ValueError(f"gates_out ({gates_out.dtype}) copies a and b ({a.dtype}, {b.dtype}): one dtype")
    if gates_out.shape != (num_tokens, 2 * num_v_heads) or gates_out.stride(-1) != 1:
        raise ValueError(f"gates_out must be [{num_tokens}, {2 * num_v_heads}] with contiguous heads")


def _check_commit_rows(row_starts: torch.Tensor, counts: torch.Tensor, num_rows: int, max_count: int) -> list[tuple]:
    """Host copies of (start, count) per request, checked against the scratch and the bound."""
    pairs = list(zip(row_starts.tolist(), counts.tolist()))
    for start, count in pairs:
        if not 0 <= count <= max_count or start < 0 or start + count > num_rows:
            raise ValueError(f"rows {start}..{start + count} (bound {max_count}) outside the {num_rows} scratch rows")
    return pairs


def commit_gated_delta_rule(
    mixed: torch.Tensor,
    gates: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    row_starts: torch.Tensor,
    counts: torch.Tensor,
    num_k_heads: int,
    max_count: int,
) -> None:
    """Advance every layer's state slots over the accepted verification rows (outputs discarded).

    mixed: [L, R, 2*Hk*dk + Hv*dv] post-conv q | k | v per row; gates: [L, R, 2*Hv] raw a | b;
    A_log, dt_bias: [L, Hv]; state: [L, num_slots, Hv, dk, dv] fp32, updated in place. Request b
    advances state[:, state_slots[b]] over rows row_starts[b] ... + counts[b] - 1 as
    recurrent_gated_delta_rule_with_gates(..., update_state=True) would; counts[b] == 0 leaves
    its slot as it was. row_starts and counts may live on the device (the fast version never
    reads them on the host); max_count bounds counts and fixes the fast version's trip count.
    """
    num_v_heads, k_dim, v_dim = state.shape[2], state.shape[3], state.shape[4]
    key_dim = (mixed.shape[-1] - num_v_heads * v_dim) // (2 * num_k_heads)
    if key_dim != k_dim or 2 * num_k_heads * k_dim + num_v_heads * v_dim != mixed.shape[-1]:
        raise ValueError(f"mixed width {mixed.shape[-1]} is not q|k|v for Hk {num_k_heads} and state {state.shape}")
    num_layers = state.shape[0]
    pairs = _check_commit_rows(row_starts, counts, mixed.shape[1], max_count)
    for slot, (start, count) in zip(state_slots.tolist(), pairs):
        if count == 0:
            continue
        rows = slice(start, start + count)
        q, k, v = mixed[:, rows].split([num_k_heads * k_dim, num_k_heads * k_dim, num_v_heads * v_dim], dim=-1)
        # The scan's outputs (from q) are discarded; the state depends on k, v and the gates only.
        qf, kf = _prepare_qk(
            q.reshape(-1, num_k_heads, k_dim), k.reshape(-1, num_k_heads, k_dim), num_v_heads
        )
        a, b = gates[:, rows].split(num_v_heads, dim=-1)  # [L, count, Hv]
        g, beta = gdn_gates(a, b, A_log[:, None, :], dt_bias[:, None, :])
        # All layers at once: _recurrent_scan takes leading batch dims ([L, count, ...]).
        _, final = _recurrent_scan(
            qf.reshape(num_layers, count, num_v_heads, k_dim),
            kf.reshape(num_layers, count, num_v_heads, k_dim),
            v.float().reshape(num_layers, count, num_v_heads, v_dim),
            g,
            beta,
            state[:, slot].float(),
        )
        state[:, slot] = final.to(state.dtype)
