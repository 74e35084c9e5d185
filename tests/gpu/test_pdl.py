"""Programmatic dependent launch on the GPU: a CUDA graph of dependent decode ops, PDL on, vs eager.

With PDL a kernel's programs start while the previous kernel drains and wait in pdl_sync
for its writes, so an early load or store would read stale data or clobber data still being
read. The chain below has every kind of dependency a decode step has, each kernel on the
output of the one before: read-after-write through fresh outputs (norm -> activation ->
gate -> norm -> GDN gates -> conv -> recurrent -> gated norm -> attention prep -> attention
-> split merge -> router -> experts -> combine), in-place state (conv and recurrent slots,
read and written by the same kernel, across replays), and the K/V cache written by
prepare_qkv and read by paged_attention right after. Consecutive kernels are all ours (views
join them, no torch kernels), so every edge of the captured graph is a programmatic one.

Each replay must equal the same chain run eagerly without PDL (NINFER_PDL=0) bit for bit:
outputs, the conv / recurrent state slots and the caches. The kernels compute the same
math with and without PDL, so any difference is a missing or misplaced wait.
Shapes: Qwen3.5-27B's Gated DeltaNet (16 k / 48 v heads of 128) and 35B-A3B's attention
(16 q / 2 kv heads of 256, 64 rotary dims) and routed experts (2048 -> 512, top 8).
Widths are joined by per-head views where no projection sits between two ops.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the PDL helpers are Triton code")

from ninfer.kernels.activation import sigmoid_mul, silu_and_mul
from ninfer.kernels.attention_prep import prepare_qkv
from ninfer.kernels.causal_conv1d import causal_conv1d_update
from ninfer.kernels.gated_delta_rule import gdn_gates, recurrent_gated_delta_rule
from ninfer.kernels.moe import fused_experts, route
from ninfer.kernels.paged_attention import paged_attention
from ninfer.kernels.pdl import pdl_enabled
from ninfer.kernels.rms_norm import add_rms_norm, gated_rms_norm, rms_norm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

EPS = 1e-6
HEAD = 128
HK, HV = 16, 48  # Qwen3.5-27B GDN heads
KEY_DIM, VALUE_DIM = HK * HEAD, HV * HEAD
CONV_DIM = 2 * KEY_DIM + VALUE_DIM  # 10240
WIDE = 2 * CONV_DIM  # gate | up of the silu_and_mul that feeds the conv
ATT_Q, ATT_KV, ATT_D, ROTARY = 16, 2, 256, 64  # Qwen3.5-35B-A3B attention
PAGE = 16
EXPERTS, TOP_K, MOE_HIDDEN, MOE_INTER = 64, 8, 2048, 512
NUM_SLOTS = 6
STEPS = 3

CHAIN_KERNELS = {
    "_add_rms_norm_kernel", "_silu_and_mul_kernel", "_sigmoid_mul_kernel", "_rms_norm_kernel",
    "_gates_kernel", "_conv_update_kernel", "_recurrent_kernel", "_gated_rms_norm_kernel",
    "_prepare_qkv_kernel", "_paged_attention_kernel", "_merge_splits_kernel",
    "_route_kernel", "_moe_up_kernel", "_moe_down_kernel", "_combine_kernel",
}  # fmt: skip


def _sm90() -> bool:
    return torch.cuda.get_device_capability()[0] >= 9


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device="cuda", generator=gen) * scale + shift).to(dtype)


def _weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "norm": _randn(gen, HEAD, scale=0.3),  # zero-centred norms
        "norm2": _randn(gen, HEAD, scale=0.3),
        "A_log": torch.rand(HV, device="cuda", generator=gen) * 2,
        "dt_bias": torch.randn(HV, device="cuda", generator=gen),
        "conv": _randn(gen, CONV_DIM, 4, scale=0.5),
        "gdn_norm": _randn(gen, HEAD, scale=0.3, shift=1.0),
        "q_norm": _randn(gen, ATT_D, scale=0.3),
        "k_norm": _randn(gen, ATT_D, scale=0.3),
        "gate_up": _randn(gen, EXPERTS, 2 * MOE_INTER, MOE_HIDDEN, scale=MOE_HIDDEN**-0.5),
        "down": _randn(gen, EXPERTS, MOE_HIDDEN, MOE_INTER, scale=MOE_INTER**-0.5),
    }


def _inputs(gen: torch.Generator, batch: int) -> dict[str, torch.Tensor]:
    angles = torch.rand(batch, ROTARY // 2, device="cuda", generator=gen) * 6.3
    angles = torch.cat((angles, angles), dim=-1)
    return {
        "x": _randn(gen, batch, WIDE),
        "residual": _randn(gen, batch, WIDE, scale=4.0),
        "cos": angles.cos().bfloat16(),
        "sin": angles.sin().bfloat16(),
    }


def _state(gen: torch.Generator, num_pages: int) -> dict[str, torch.Tensor]:
    return {
        "conv": _randn(gen, NUM_SLOTS, CONV_DIM, 3),
        "ssm": torch.randn(NUM_SLOTS, HV, HEAD, HEAD, device="cuda", generator=gen) * 0.5,
        "k_cache": _randn(gen, num_pages, PAGE, ATT_KV, ATT_D),
        "v_cache": _randn(gen, num_pages, PAGE, ATT_KV, ATT_D),
    }


def _chain(inp, state, w, meta, batch: int) -> dict[str, torch.Tensor]:
    """One decode-like step; every op reads what an earlier op of this step wrote."""
    rows = WIDE // HEAD
    normed, summed = add_rms_norm(
        inp["x"].view(batch, rows, HEAD), inp["residual"].view(batch, rows, HEAD), w["norm"], EPS, True,
        early_residual=True,  # the residual is an input: written before the step
    )  # fmt: skip
    act = silu_and_mul(normed.view(batch, WIDE))  # [B, CONV_DIM]
    gated = sigmoid_mul(act, summed.view(batch, WIDE)[:, CONV_DIM:])  # gate: strided rows of an earlier output
    conv_in = rms_norm(gated.view(batch, CONV_DIM // HEAD, HEAD), w["norm2"], EPS, True).view(batch, CONV_DIM)
    g, beta = gdn_gates(conv_in[:, :HV], conv_in[:, HV : 2 * HV], w["A_log"], w["dt_bias"])
    mixed = causal_conv1d_update(conv_in, w["conv"], state["conv"], meta["state_slots"])
    q, k, v = mixed.split([KEY_DIM, KEY_DIM, VALUE_DIM], dim=-1)
    core = recurrent_gated_delta_rule(
        q.view(batch, HK, HEAD), k.view(batch, HK, HEAD), v.view(batch, HV, HEAD),
        g, beta, state["ssm"], meta["state_slots"], (1,) * batch,
    )  # fmt: skip
    z = summed.view(batch, WIDE)[:, :VALUE_DIM].view(batch, HV, HEAD)
    y = gated_rms_norm(core, z, w["gdn_norm"], EPS, early_gate=True).view(batch, VALUE_DIM)  # z: 8 launches back
    q_cols, kv_cols = ATT_Q * ATT_D, ATT_KV * ATT_D
    q_out = prepare_qkv(
        y[:, :q_cols].view(batch, ATT_Q, ATT_D),
        y[:, q_cols : q_cols + kv_cols].view(batch, ATT_KV, ATT_D),
        y[:, q_cols + kv_cols : q_cols + 2 * kv_cols].view(batch, ATT_KV, ATT_D),
        w["q_norm"], w["k_norm"], EPS, True, inp["cos"], inp["sin"],
        state["k_cache"], state["v_cache"], meta["slot_mapping"],
    )  # fmt: skip
    attn = paged_attention(
        q_out, state["k_cache"], state["v_cache"], meta["page_table"], meta["query_start_loc"], meta["seq_lens"],
        ATT_D**-0.5, max_query_len=1, prefetch_kv=True,  # as the model: prepare_qkv just wrote the new keys
    )  # fmt: skip
    flat = attn.view(batch, ATT_Q * ATT_D)
    weights, ids = route(flat[:, :EXPERTS], TOP_K, True)
    moe = fused_experts(flat[:, ATT_Q * ATT_D - MOE_HIDDEN :], weights, ids, w["gate_up"], w["down"])
    return {
        "normed": normed, "summed": summed, "act": act, "gated": gated, "conv_in": conv_in, "g": g, "beta": beta,
        "mixed": mixed, "core": core, "y": y, "q_out": q_out, "attn": attn, "weights": weights, "ids": ids, "moe": moe,
    }  # fmt: skip


def _metadata(batch: int, contexts: list[int], gen: torch.Generator):
    pages_per_request = [-(-(c + STEPS) // PAGE) for c in contexts]
    num_pages = sum(pages_per_request) + 5
    order = torch.randperm(num_pages, device="cuda", generator=gen)
    page_table = torch.zeros(batch, max(pages_per_request), dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(pages_per_request):
        page_table[b, :n] = order[used : used + n].int()
        used += n
    meta = {
        "page_table": page_table,
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        "seq_lens": torch.empty(batch, dtype=torch.int32, device="cuda"),
        "slot_mapping": torch.empty(batch, dtype=torch.int64, device="cuda"),
        "state_slots": torch.tensor([3, 0, 5, 1][:batch], dtype=torch.int64, device="cuda"),
    }
    context = torch.tensor(contexts, device="cuda")

    def at_step(step: int) -> None:
        """The lengths and new-token cache slots of decode step `step` (copied in place)."""
        position = context + step
        page = page_table.gather(1, (position // PAGE).view(-1, 1)).view(-1).long()
        meta["seq_lens"].copy_(position + 1)
        meta["slot_mapping"].copy_(page * PAGE + position % PAGE)

    return meta, at_step, num_pages


def _copy(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> None:
    for name, tensor in src.items():
        dst[name].copy_(tensor)


def _clone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in tensors.items()}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for name in want:
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs"


@pytest.mark.parametrize("batch, contexts", [(1, [3000]), (4, [700, 1500, 33, 2000])])
def test_pdl_chain_in_a_cuda_graph_equals_eager_without_pdl(batch, contexts, monkeypatch: pytest.MonkeyPatch) -> None:
    if not _sm90():
        pytest.skip("PDL needs sm_90 or later")
    from triton.runtime.jit import JITFunction

    gen = torch.Generator("cuda").manual_seed(batch)
    w = _weights(gen)
    meta, at_step, num_pages = _metadata(batch, contexts, gen)
    start = _state(gen, num_pages)
    static_in = _inputs(gen, batch)
    graph_state = _clone(start)

    monkeypatch.setenv("NINFER_PDL", "1")
    assert pdl_enabled(static_in["x"])
    at_step(0)
    _chain(static_in, graph_state, w, meta, batch)  # compile the PDL variants outside the capture
    torch.cuda.synchronize()
    _copy(graph_state, start)

    # Record every Triton launch of the capture: all must be PDL launches of PDL builds.
    launches: list[tuple[str, bool, bool]] = []
    original_run = JITFunction.run

    def recording_run(self, *args, **kwargs):
        kernel = original_run(self, *args, **kwargs)
        launches.append((self.fn.__name__, kernel.metadata.launch_pdl, "griddepcontrol.wait" in kernel.asm["ptx"]))
        return kernel

    monkeypatch.setattr(JITFunction, "run", recording_run)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _chain(static_in, graph_state, w, meta, batch)
    monkeypatch.setattr(JITFunction, "run", original_run)
    assert {name for name, _, _ in launches} == CHAIN_KERNELS
    not_pdl = [name for name, pdl, waits in launches if not (pdl and waits)]
    assert not not_pdl, f"launched without PDL: {not_pdl}"

    eager_state = _clone(start)
    for step in range(STEPS):
        new = _inputs(torch.Generator("cuda").manual_seed(100 + step), batch)
        at_step(step)
        _copy(static_in, new)
        graph.replay()
        monkeypatch.setenv("NINFER_PDL", "0")
        assert not pdl_enabled(new["x"])
        expected = _chain(new, eager_state, w, meta, batch)
        monkeypatch.setenv("NINFER_PDL", "1")
        torch.cuda.synchronize()
        _assert_equal(static_out, expected, f"replay {step}")
        _assert_equal(graph_state, eager_state, f"state after replay {step}")
        assert torch.isfinite(static_out["moe"].float()).all()
    assert not torch.equal(eager_state["ssm"], start["ssm"])  # the steps really advanced the state
    assert not torch.equal(eager_state["conv"], start["conv"])


def test_pdl_enabled_on_sm90_unless_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    if not _sm90():
        pytest.skip("PDL needs sm_90 or later")
    x = torch.zeros(8, dtype=torch.bfloat16, device="cuda")
    monkeypatch.delenv("NINFER_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl_enabled(x) is True
    monkeypatch.setenv("NINFER_PDL", "0")
    assert pdl_enabled(x) is False
    monkeypatch.setenv("NINFER_PDL", "1")
    assert pdl_enabled(x) is True
    assert pdl_enabled(x.cpu()) is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl_enabled(x) is False
