"""Gated delta rule on the GPU: our own recurrent kernel for decode, fla's chunked kernels for prefill.

Recurrent form (decode rounds, short verify rows): one Triton program owns one request's
v-head and a BLOCK_V-column strip of its fp32 state [dk, dv] (the strips of a head are
independent: every column of S evolves on its own given k, q, g, beta). The strip is read
from the request's slot once, advanced token by token in registers, and written back to
the same slot, so a step moves each state byte exactly twice (read + write) with no
gather/scatter copies. When every request has the same number of rows (a decode round
has one each) the rows of request b are b*L ... b*L+L-1 and nothing but the slot ids is
read from memory that the host fills per step: the launch is the same every round, which
is what a CUDA graph replays. Unequal lengths pass a cu_seqlens tensor built on the host
(not capture-safe; the engine only sends those to the chunked form). Speculative verification
rows (state not written) also leave their raw gates a | b in the caller's scratch (gates_out),
stored as loaded by the programs of each head's first column strip.

Commit of speculative verification rows (commit_gated_delta_rule): the same state update
over each request's accepted rows, for every GDN layer in one launch (programs per request,
layer * v-head and column strip). The rows' starts and counts are loaded by the kernel and
the trip count is a host bound, so the launch is capture-safe and needs no host sync.

Chunked form (prefill chunks): flash-linear-attention's `chunk_gated_delta_rule` over the
whole varlen batch (cu_seqlens), with the initial states gathered from the slots and the
final states scattered back. fla is imported lazily; without it the reference runs.

Gates (gdn_gates): g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) in one
launch instead of ~8 elementwise torch kernels; one program per BLOCK_T rows, all heads.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ninfer.kernels.backend import fast_version
from ninfer.kernels.gated_delta_rule import ref
from ninfer.kernels.pdl import pdl_enabled, pdl_sync
from ninfer.kernels.sm_count import device_sms
from ninfer.kernels.varlen import start_offsets

# Programs own BLOCK_V state columns (dk * BLOCK_V * 4 bytes). H200 sweep (docs/kernels.md):
# at batch 1 the narrowest strips win (27B: 384 programs of 8 KiB, 3.95 us vs 4.5 at 32
# columns), at batch 8 64 columns do (768 programs, 17.1 us, 70 % of copy bandwidth); the
# rule below takes the widest strip that still gives every SM three programs.
BLOCK_V_CHOICES = (64, 32, 16)
PROGRAMS_PER_SM = 3
NUM_WARPS = 4


def _block_v(device: torch.device, num_requests: int, num_v_heads: int, v_dim: int) -> int:
    if device.type != "cuda":
        return 32  # the CPU interpreter: any width is correct
    target = PROGRAMS_PER_SM * device_sms(device)
    for block_v in BLOCK_V_CHOICES:
        if num_requests * num_v_heads * triton.cdiv(v_dim, block_v) >= target:
            return block_v
    return BLOCK_V_CHOICES[-1]


# torch's F.softplus default: x itself above this (beta = 1), where log1p(exp(x)) == x in fp32 anyway.
SOFTPLUS_THRESHOLD = 20.0
GATES_BLOCK_T = 16


@triton.jit
def _log1p(u):
    """log(1 + u) to a few ulp for tiny u too (Goldberg): the rounding of 1 + u cancels in
    log(w) / (w - 1). libdevice's log1p would do, but the CPU interpreter lacks libdevice."""
    w = 1.0 + u
    exact = w == 1.0
    return tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, w - 1.0)))


@triton.jit
def _gate_values(a, b, a_log, dt_bias, THRESHOLD: tl.constexpr):
    """fp32 (g, beta) from the raw projections: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""
    x = a + dt_bias
    # Clamped (NaN kept) so the branch that where() drops cannot overflow exp.
    softplus = tl.where(x > THRESHOLD, x, _log1p(tl.exp(tl.where(x > THRESHOLD, THRESHOLD, x))))
    return -tl.exp(a_log) * softplus, tl.sigmoid(b)


@triton.jit
def _gates_kernel(
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    g_ptr,
    beta_ptr,
    num_tokens,
    stride_at,
    stride_bt,
    stride_a_log,
    stride_dt_bias,
    NUM_HEADS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    THRESHOLD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)  # before the first global load or store
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_H)
    mask_h = h < NUM_HEADS
    mask = (t < num_tokens)[:, None] & mask_h[None, :]
    a = tl.load(a_ptr + t[:, None] * stride_at + h[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t[:, None] * stride_bt + h[None, :], mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + h * stride_a_log, mask=mask_h, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h * stride_dt_bias, mask=mask_h, other=0.0).to(tl.float32)
    g, beta = _gate_values(a, b, a_log[None, :], dt_bias[None, :], THRESHOLD)
    out = t[:, None] * NUM_HEADS + h[None, :]  # g and beta are fresh contiguous [T, Hv]
    tl.store(g_ptr + out, g, mask=mask)
    tl.store(beta_ptr + out, beta, mask=mask)


def _check_gate_projections(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
    """The kernels read a and b as [T, Hv] and one A_log / dt_bias value per head."""
    num_heads = a.shape[1]
    if b.shape != a.shape or A_log.shape != (num_heads,) or dt_bias.shape != (num_heads,):
        raise ValueError(f"a {tuple(a.shape)}, b {tuple(b.shape)}, A_log/dt_bias must be [{num_heads}]")


@fast_version(ref.gdn_gates)
def gdn_gates(a, b, A_log, dt_bias):
    """One launch; capture-safe (the grid is from T alone).

    a, b may be strided row views (column slices of a packed projection); heads contiguous.
    """
    num_tokens, num_heads = a.shape
    g = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=a.device)
    beta = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=a.device)
    if num_tokens == 0:
        return g, beta
    _check_gate_projections(a, b, A_log, dt_bias)
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(f"a and b need contiguous heads, got strides {a.stride()} and {b.stride()}")
    use_pdl = pdl_enabled(a)
    _gates_kernel[(triton.cdiv(num_tokens, GATES_BLOCK_T),)](
        a,
        b,
        A_log,
        dt_bias,
        g,
        beta,
        num_tokens,
        a.stride(0),
        b.stride(0),
        A_log.stride(0),
        dt_bias.stride(0),
        NUM_HEADS=num_heads,
        BLOCK_T=GATES_BLOCK_T,
        BLOCK_H=triton.next_power_of_2(num_heads),
        THRESHOLD=SOFTPLUS_THRESHOLD,
        USE_PDL=use_pdl,
        num_warps=2,
        launch_pdl=use_pdl,
    )
    return g, beta


@triton.jit
def _l2norm(x, eps):
    """x / sqrt(sum x^2 + eps), eps inside the rsqrt as in the reference; shared by the decode and
    commit kernels so that both advance a state by the same arithmetic."""
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + eps)


@triton.jit
def _recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    a_log_ptr,
    dt_bias_ptr,
    out_ptr,
    state_ptr,
    slots_ptr,
    cu_seqlens_ptr,
    gates_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_slot,
    stride_got,
    max_len,
    scale,
    eps,
    NUM_K_HEADS: tl.constexpr,
    NUM_V_HEADS: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    VARLEN: tl.constexpr,
    RAW_GATES: tl.constexpr,
    THRESHOLD: tl.constexpr,
    WRITE_STATE: tl.constexpr,
    STORE_GATES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """RAW_GATES: g_ptr / beta_ptr hold the projections a / b, and the gates are computed here
    (saving the gates kernel's launch in a decode step). STORE_GATES (with RAW_GATES): the
    programs of the first column strip also store a | b as loaded into gates_out's rows, the raw
    gates speculative verification keeps for its commit (saving two copy launches per layer).

    Before pdl_sync (see ninfer.kernels.pdl): the lengths, the slot, the gate parameters and
    the state, which only this kernel writes (one step earlier); q, k, v and the gates are
    the previous kernels' outputs."""
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    i_hk = i_h // (NUM_V_HEADS // NUM_K_HEADS)  # grouped value heads share their k/q head
    if VARLEN:
        bos = tl.load(cu_seqlens_ptr + i_b).to(tl.int64)
        length = tl.load(cu_seqlens_ptr + i_b + 1).to(tl.int64) - bos
    else:
        bos = i_b.to(tl.int64) * max_len
        length = max_len
    slot = tl.load(slots_ptr + i_b).to(tl.int64)
    if RAW_GATES:
        a_log = tl.load(a_log_ptr + i_h).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + i_h).to(tl.float32)

    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = o_k < DK
    mask_v = o_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]
    p_state = state_ptr + slot * stride_slot + (i_h * DK + o_k[:, None]) * DV + o_v[None, :]
    s = tl.load(p_state, mask=mask_s, other=0.0).to(tl.float32)
    pdl_sync(USE_PDL)

    # The trip count is a host int (the longest request), never a loaded value. In varlen
    # mode a request's steps past its end load g = beta = 0, which leaves s unchanged
    # (decay exp(0) = 1, update beta * ... = 0), and store nothing.
    for i in range(max_len):
        t = bos + i
        live = i < length
        m_k = mask_k & live
        m_v = mask_v & live
        b_q = tl.load(q_ptr + t * stride_qt + i_hk * stride_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k_ptr + t * stride_kt + i_hk * stride_kh + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + t * stride_vt + i_h * stride_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
        raw_g = tl.load(g_ptr + t * stride_gt + i_h, mask=live, other=0.0)
        raw_beta = tl.load(beta_ptr + t * stride_bt + i_h, mask=live, other=0.0)
        if STORE_GATES:  # one program per (row, head) stores, the loaded values unconverted
            first_strip = live & (i_v == 0)
            tl.store(gates_out_ptr + t * stride_got + i_h, raw_g, mask=first_strip)
            tl.store(gates_out_ptr + t * stride_got + NUM_V_HEADS + i_h, raw_beta, mask=first_strip)
        b_g = raw_g.to(tl.float32)
        b_beta = raw_beta.to(tl.float32)
        if RAW_GATES:
            b_g, b_beta = _gate_values(b_g, b_beta, a_log, dt_bias, THRESHOLD)
            b_g = tl.where(live, b_g, 0.0)  # steps past a request's end must stay no-ops
            b_beta = tl.where(live, b_beta, 0.0)
        b_q = _l2norm(b_q, eps) * scale  # q also takes dk^-0.5
        b_k = _l2norm(b_k, eps)
        s = s * tl.exp(b_g)
        u = b_beta * (b_v - tl.sum(s * b_k[:, None], axis=0))
        s = s + b_k[:, None] * u[None, :]
        b_o = tl.sum(s * b_q[:, None], axis=0)
        tl.store(out_ptr + t * stride_ot + i_h * stride_oh + o_v, b_o.to(out_ptr.dtype.element_ty), mask=m_v)

    if WRITE_STATE:  # off for speculative verification, which commits the accepted rows later
        tl.store(p_state, s.to(state_ptr.dtype.element_ty), mask=mask_s)


def _check_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor) -> None:
    # Rows may be strided (q, k, v are column slices of the conv output); heads and features not.
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name} must have contiguous [heads, dim] rows, got strides {t.stride()}")
    if not state[0].is_contiguous():
        raise ValueError("each state slot must be a contiguous [Hv, dk, dv] block")


@fast_version(ref.recurrent_gated_delta_rule)
def recurrent_gated_delta_rule(
    q, k, v, g, beta, state, state_slots, query_lens, update_state=True, *,
    block_v: int | None = None,
    num_warps: int = NUM_WARPS,
):
    """State slots are updated in place.

    Capture-safe when all query_lens are equal (a decode round): the host tuple only fixes
    the grid. block_v / num_warps override the tile choice, for the benchmark.
    """
    return _recurrent(q, k, v, g, beta, None, state, state_slots, query_lens, block_v, num_warps, update_state)


@fast_version(ref.recurrent_gated_delta_rule_with_gates)
def recurrent_gated_delta_rule_with_gates(
    q, k, v, a, b, A_log, dt_bias, state, state_slots, query_lens, update_state=True, *, gates_out=None
):
    """The gates computed in the recurrent kernel from the raw projections (a, b may be strided
    row views), which the kernel also stores into gates_out when given."""
    _check_gate_projections(a, b, A_log, dt_bias)
    ref.check_gates_out(a, b, query_lens, gates_out)
    return _recurrent(
        q, k, v, a, b, (A_log, dt_bias), state, state_slots, query_lens, None, NUM_WARPS, update_state, gates_out
    )


def _recurrent(
    q, k, v, g, beta, raw_gate_params, state, state_slots, query_lens, block_v, num_warps, update_state, gates_out=None
):
    """g / beta are the gates, or (raw_gate_params = (A_log, dt_bias)) the projections a / b;
    gates_out (raw gates only) receives a | b."""
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1], v.shape[2]
    out = torch.empty((num_tokens, num_v_heads, v_dim), dtype=v.dtype, device=v.device)
    num_requests = len(query_lens)
    if num_requests == 0 or num_tokens == 0:
        return out
    _check_layout(q, k, v, state)
    if g.stride(1) != 1 or beta.stride(1) != 1:
        raise ValueError("g and beta must be [T, Hv] with contiguous heads")
    equal = all(n == query_lens[0] for n in query_lens)
    if equal:
        if num_requests * query_lens[0] != num_tokens:
            raise ValueError(f"query_lens {query_lens} do not cover {num_tokens} rows")
        cu_seqlens = state_slots  # unused placeholder pointer
    else:
        cu_seqlens = start_offsets(tuple(query_lens), q.device)
    block_v = block_v or _block_v(q.device, num_requests, num_v_heads, v_dim)
    grid = (num_requests, num_v_heads, triton.cdiv(v_dim, block_v))
    use_pdl = pdl_enabled(q)
    _recurrent_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        *(raw_gate_params or (g, g)),  # A_log / dt_bias, or unused placeholders
        out,
        state,
        state_slots,
        cu_seqlens,
        gates_out if gates_out is not None else out,  # unused placeholder without gates_out
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        out.stride(0),
        out.stride(1),
        state.stride(0),
        gates_out.stride(0) if gates_out is not None else 0,
        max(query_lens),
        k_dim**-0.5,
        ref.L2NORM_EPS,
        NUM_K_HEADS=num_k_heads,
        NUM_V_HEADS=num_v_heads,
        DK=k_dim,
        DV=v_dim,
        BLOCK_K=triton.next_power_of_2(k_dim),
        BLOCK_V=block_v,
        VARLEN=not equal,
        RAW_GATES=raw_gate_params is not None,
        THRESHOLD=SOFTPLUS_THRESHOLD,
        WRITE_STATE=update_state,
        STORE_GATES=gates_out is not None,
        USE_PDL=use_pdl,
        num_warps=num_warps,
        launch_pdl=use_pdl,
    )
    return out


@triton.jit
def _commit_kernel(
    mixed_ptr,
    gates_ptr,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    slots_ptr,
    starts_ptr,
    counts_ptr,
    stride_ml,
    stride_mr,
    stride_gl,
    stride_gr,
    stride_al,
    stride_ah,
    stride_dl,
    stride_dh,
    stride_sl,
    stride_slot,
    max_count,
    eps,
    NUM_K_HEADS: tl.constexpr,
    NUM_V_HEADS: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    THRESHOLD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per (request, layer * Hv + v-head, BLOCK_V state columns): the decode kernel's
    state update over the request's accepted rows, without q and the outputs.

    pdl_sync comes first: the counts (and starts) are written on the device by the acceptance
    step just before, and the slot decides every other address."""
    pdl_sync(USE_PDL)
    i_b = tl.program_id(0)
    i_lh = tl.program_id(1)
    i_v = tl.program_id(2)
    i_l = i_lh // NUM_V_HEADS
    i_h = i_lh % NUM_V_HEADS
    i_hk = i_h // (NUM_V_HEADS // NUM_K_HEADS)  # grouped value heads share their k head
    start = tl.load(starts_ptr + i_b).to(tl.int64)
    count = tl.load(counts_ptr + i_b).to(tl.int64)
    slot = tl.load(slots_ptr + i_b).to(tl.int64)
    a_log = tl.load(a_log_ptr + i_l * stride_al + i_h * stride_ah).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + i_l * stride_dl + i_h * stride_dh).to(tl.float32)

    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = o_k < DK
    mask_v = o_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]
    p_state = state_ptr + i_l.to(tl.int64) * stride_sl + slot * stride_slot + (i_h * DK + o_k[:, None]) * DV + o_v[None, :]
    s = tl.load(p_state, mask=mask_s & (count > 0), other=0.0).to(tl.float32)
    p_rows = mixed_ptr + i_l.to(tl.int64) * stride_ml + start * stride_mr
    p_gates = gates_ptr + i_l.to(tl.int64) * stride_gl + start * stride_gr
    k_col = NUM_K_HEADS * DK + i_hk * DK  # row layout q | k | v
    v_col = 2 * NUM_K_HEADS * DK + i_h * DV

    # Host trip count (fixed per captured graph); steps past the request's count take g = beta = 0,
    # which leave s unchanged (decay exp(0) = 1, update 0), as the decode kernel's varlen tails.
    for i in range(max_count):
        live = i < count
        b_k = tl.load(p_rows + i * stride_mr + k_col + o_k, mask=mask_k & live, other=0.0).to(tl.float32)
        b_v = tl.load(p_rows + i * stride_mr + v_col + o_v, mask=mask_v & live, other=0.0).to(tl.float32)
        b_a = tl.load(p_gates + i * stride_gr + i_h, mask=live, other=0.0).to(tl.float32)
        b_b = tl.load(p_gates + i * stride_gr + NUM_V_HEADS + i_h, mask=live, other=0.0).to(tl.float32)
        b_g, b_beta = _gate_values(b_a, b_b, a_log, dt_bias, THRESHOLD)
        b_g = tl.where(live, b_g, 0.0)
        b_beta = tl.where(live, b_beta, 0.0)
        b_k = _l2norm(b_k, eps)
        s = s * tl.exp(b_g)
        u = b_beta * (b_v - tl.sum(s * b_k[:, None], axis=0))
        s = s + b_k[:, None] * u[None, :]

    tl.store(p_state, s.to(state_ptr.dtype.element_ty), mask=mask_s & (count > 0))


@fast_version(ref.commit_gated_delta_rule)
def commit_gated_delta_rule(
    mixed, gates, A_log, dt_bias, state, state_slots, row_starts, counts, num_k_heads, max_count, *,
    block_v: int | None = None,
    num_warps: int = NUM_WARPS,
):
    """One launch for all layers and requests.

    Capture-safe: row_starts, counts and slots are only read by the kernel, and the grid and trip
    count come from shapes and max_count. mixed / gates rows may be strided (channels contiguous).
    """
    num_layers, _, num_v_heads, k_dim, v_dim = state.shape
    if 2 * num_k_heads * k_dim + num_v_heads * v_dim != mixed.shape[-1]:
        raise ValueError(f"mixed width {mixed.shape[-1]} is not q|k|v for Hk {num_k_heads} and state {state.shape}")
    if gates.shape[-1] != 2 * num_v_heads or A_log.shape != (num_layers, num_v_heads) or dt_bias.shape != A_log.shape:
        raise ValueError(f"gates {tuple(gates.shape)}, A_log {tuple(A_log.shape)}: need 2*Hv gates and [L, Hv]")
    if mixed.stride(-1) != 1 or gates.stride(-1) != 1:
        raise ValueError("mixed and gates need contiguous channels")
    if state.stride(-1) != 1 or state.stride(-2) != v_dim or state.stride(-3) != k_dim * v_dim:
        raise ValueError("each state slot must be a contiguous [Hv, dk, dv] block")
    num_requests = state_slots.shape[0]
    if num_requests == 0 or num_layers == 0 or max_count == 0:
        return
    block_v = block_v or _block_v(state.device, num_requests * num_layers, num_v_heads, v_dim)
    grid = (num_requests, num_layers * num_v_heads, triton.cdiv(v_dim, block_v))
    use_pdl = pdl_enabled(state)
    _commit_kernel[grid](
        mixed,
        gates,
        A_log,
        dt_bias,
        state,
        state_slots,
        row_starts,
        counts,
        mixed.stride(0),
        mixed.stride(1),
        gates.stride(0),
        gates.stride(1),
        A_log.stride(0),
        A_log.stride(1),
        dt_bias.stride(0),
        dt_bias.stride(1),
        state.stride(0),
        state.stride(1),
        max_count,
        ref.L2NORM_EPS,
        NUM_K_HEADS=num_k_heads,
        NUM_V_HEADS=num_v_heads,
        DK=k_dim,
        DV=v_dim,
        BLOCK_K=triton.next_power_of_2(k_dim),
        BLOCK_V=block_v,
        THRESHOLD=SOFTPLUS_THRESHOLD,
        USE_PDL=use_pdl,
        num_warps=num_warps,
        launch_pdl=use_pdl,
    )


# fla's chunk_gated_delta_rule default, and the unit of the chunk lists the padded form's contract
# gives (ref.chunk_gated_delta_rule_padded).
FLA_CHUNK_SIZE = ref.CHUNK_SIZE


@functools.lru_cache(maxsize=16)
def _varlen_metadata(lengths: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(cu_seqlens, chunk_indices, chunk_offsets) on the device for fla.

    Built once per distinct set of request lengths (a prefill step's), then the same tensors
    for every GDN layer of the step: fla's own chunk-index build copies to the device with a
    stream sync in each call (one per layer, each draining the GPU queue). Nothing writes them.
    """
    chunks = [triton.cdiv(n, FLA_CHUNK_SIZE) for n in lengths]
    # [sequence, chunk within it] per chunk of FLA_CHUNK_SIZE tokens, as fla's prepare_chunk_indices
    chunk_indices = torch.tensor(
        [[seq, chunk] for seq, count in enumerate(chunks) for chunk in range(count)], dtype=torch.int64
    ).reshape(-1, 2)
    pinned = device.type == "cuda"
    if pinned:
        chunk_indices = chunk_indices.pin_memory()
    return (
        start_offsets(lengths, device),
        chunk_indices.to(device, non_blocking=pinned),
        start_offsets(tuple(chunks), device),
    )


@functools.cache
def _fla_chunk():
    """fla's chunked forward, or None when fla-core (flash-linear-attention's kernels) is not installed.

    Its public function wraps the forward in an autograd Function, input guards and
    dispatch decorators: ~1.5 ms of host time per call, 45 ms over the 30 GDN layers of a
    prefill step, which the host must spend ahead of the GPU. The steps below are what its
    forward runs for inference (fla-core 0.6, pinned < 0.7 in pyproject.toml), with the chunk
    offsets passed in: fla would derive them from cu_seqlens and cache them by the tensor's
    identity, which a captured graph's static offsets would turn stale.
    """
    try:
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
    except ImportError:
        return None

    def forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_indices, chunk_offsets):
        """-> (o, final_state), as fla's chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)."""
        varlen = {"cu_seqlens": cu_seqlens, "chunk_indices": chunk_indices}
        q, k = l2norm_fwd(q)[0], l2norm_fwd(k)[0]
        # fla's kernels exponentiate in base 2: the gates' cumulative sums are scaled by 1 / ln 2.
        g = chunk_local_cumsum(g, chunk_size=FLA_CHUNK_SIZE, scale=RCP_LN2, **varlen)
        w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, chunk_size=FLA_CHUNK_SIZE, **varlen)
        h, v_new, final_state = chunk_gated_delta_rule_fwd_h(
            k=k, w=w, u=u, g=g, initial_state=initial_state, output_final_state=True, chunk_size=FLA_CHUNK_SIZE,
            chunk_offsets=chunk_offsets, **varlen,
        )  # fmt: skip
        o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, chunk_size=FLA_CHUNK_SIZE, **varlen)
        return o, final_state

    return forward


@fast_version(ref.chunk_gated_delta_rule)
def chunk_gated_delta_rule(q, k, v, g, beta, state, state_slots, query_lens):
    """Through fla's varlen chunked kernels.

    Not capture-safe (host-built offsets; chunk_gated_delta_rule_padded is the captured form).
    Empty requests are dropped: they leave their slot unchanged.
    """
    fla_chunk = _fla_chunk()
    if fla_chunk is None:
        return ref.chunk_gated_delta_rule(q, k, v, g, beta, state, state_slots, query_lens)
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return torch.empty(v.shape, dtype=v.dtype, device=v.device)
    keep = [i for i, n in enumerate(query_lens) if n > 0]
    slots = state_slots if len(keep) == len(query_lens) else state_slots[torch.tensor(keep, device=q.device)]
    cu_seqlens, chunk_indices, chunk_offsets = _varlen_metadata(tuple(query_lens[i] for i in keep), q.device)
    return _rule(fla_chunk, q, k, v, g, beta, state, slots, cu_seqlens, chunk_indices, chunk_offsets)


@fast_version(ref.chunk_gated_delta_rule_padded)
def chunk_gated_delta_rule_padded(q, k, v, g, beta, state, state_slots, starts, chunk_indices, chunk_offsets):
    """fla's kernels over offsets and chunk
    lists read on the device, with grids from their fixed lengths; the padding chunks belong to an
    empty request, so their programs load and store nothing. Capture-safe."""
    fla_chunk = _fla_chunk()
    if fla_chunk is None:
        return ref.chunk_gated_delta_rule_padded(q, k, v, g, beta, state, state_slots, starts, chunk_indices,
                                                 chunk_offsets)
    return _rule(fla_chunk, q, k, v, g, beta, state, state_slots, starts, chunk_indices, chunk_offsets, padded=True)


def _rule(fla_chunk, q, k, v, g, beta, state, slots, cu_seqlens, chunk_indices, chunk_offsets, padded=False):
    """fla's chunked rule from the slots' states, the final states scattered back. padded: the
    copies skip the empty requests (most of a padded step's table), whose states fla reads and
    writes but nothing uses."""
    if padded:
        initial = gather_state_rows(state, slots, cu_seqlens)
    else:
        initial = state.index_select(0, slots).float()
    with torch.no_grad():
        # fla's layout: one packed "batch" of sequences; its kernels want contiguous inputs.
        out, final = fla_chunk(
            q.unsqueeze(0).contiguous(),
            k.unsqueeze(0).contiguous(),
            v.unsqueeze(0).contiguous(),
            g.float().unsqueeze(0).contiguous(),
            beta.unsqueeze(0).contiguous(),
            q.shape[-1] ** -0.5,
            initial,
            cu_seqlens,
            chunk_indices,
            chunk_offsets,
        )
    if padded:
        scatter_state_rows(state, slots, cu_seqlens, final)
    else:
        state.index_copy_(0, slots, final.to(state.dtype))
    return out[0].to(v.dtype)


STATE_COPY_BLOCK = 4096  # fp32 elements per program: 16 KiB


@triton.jit
def _state_rows_kernel(src_ptr, dst_ptr, slots_ptr, starts_ptr, row_elems, stride_slot, GATHER: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Program (request b, block): copies one block of b's state between its slot and row b,
    nothing for an empty request."""
    b = tl.program_id(0)
    if tl.load(starts_ptr + b + 1) == tl.load(starts_ptr + b):
        return
    slot = tl.load(slots_ptr + b).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_elems
    if GATHER:
        values = tl.load(src_ptr + slot * stride_slot + offs, mask=mask)
        tl.store(dst_ptr + b.to(tl.int64) * row_elems + offs, values.to(tl.float32), mask=mask)
    else:
        values = tl.load(src_ptr + b.to(tl.int64) * row_elems + offs, mask=mask)
        tl.store(dst_ptr + slot * stride_slot + offs, values.to(dst_ptr.dtype.element_ty), mask=mask)


@fast_version(ref.gather_state_rows)
def gather_state_rows(state, state_slots, starts):
    """One launch, empty requests' programs exit."""
    rows = state_slots.shape[0]
    out = torch.empty((rows, *state.shape[1:]), dtype=torch.float32, device=state.device)
    _copy_state_rows(state, out, state_slots, starts, gather=True)
    return out


@fast_version(ref.scatter_state_rows)
def scatter_state_rows(state, state_slots, starts, rows):
    _copy_state_rows(rows.contiguous(), state, state_slots, starts, gather=False)


def _copy_state_rows(src: torch.Tensor, dst: torch.Tensor, state_slots, starts, gather: bool) -> None:
    state = src if gather else dst
    if not state[0].is_contiguous():
        raise ValueError("each state slot must be a contiguous block")
    row_elems = state[0].numel()
    grid = (state_slots.shape[0], triton.cdiv(row_elems, STATE_COPY_BLOCK))
    _state_rows_kernel[grid](src, dst, state_slots, starts, row_elems, state.stride(0), GATHER=gather,
                             BLOCK=STATE_COPY_BLOCK)
