"""Gated delta rule fast path on the GPU vs ref.py at the real head shapes; CUDA-graph decode.

Chunked prefill goes through fla's kernels, which keep q, k, v, the l2-normalised q/k and
the per-chunk states in bf16 for their matmuls: against the fp32 reference on the same
bf16 inputs they agree to about 1e-2 relative, not to fp32 rounding. Our recurrent decode
kernel does the reference's fp32 arithmetic in another order: its fp32 state agrees to
~1e-5 and its bf16 output to one rounding.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.causal_conv1d import causal_conv1d_update
from ninfer.kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_padded,
    gdn_gates,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_with_gates,
    ref,
)
from tests.ulp import assert_matches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEAD_DIM = 128
SHAPES = {"27B": (16, 48), "35B-A3B": (16, 32)}  # (Hk, Hv); dk = dv = 128
NUM_SLOTS = 9
# Relative-norm bounds for fla's bf16 chunked kernels vs the fp32 reference (see docstring).
CHUNK_OUT_REL, CHUNK_STATE_REL = 2e-2, 1e-2


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.double(), expected.double()
    assert torch.isfinite(out).all()
    return ((out - expected).norm() / expected.norm()).item()


def _inputs(num_tokens: int, shape: str, seed: int):
    """q, k, v as strided column slices of one bf16 conv output, fp32 gates, random slot states."""
    num_k_heads, num_v_heads = SHAPES[shape]
    gen = torch.Generator("cuda").manual_seed(seed)
    key_dim, value_dim = num_k_heads * HEAD_DIM, num_v_heads * HEAD_DIM
    conv = torch.randn(num_tokens, 2 * key_dim + value_dim, device="cuda", generator=gen).bfloat16()
    q = conv[:, :key_dim].reshape(num_tokens, num_k_heads, HEAD_DIM)
    k = conv[:, key_dim : 2 * key_dim].reshape(num_tokens, num_k_heads, HEAD_DIM)
    v = conv[:, 2 * key_dim :].reshape(num_tokens, num_v_heads, HEAD_DIM)
    # Decays from almost none (long memory) to strong, so chunk boundaries carry real state.
    g = -(torch.rand(num_tokens, num_v_heads, device="cuda", generator=gen) ** 3) * 2
    beta = torch.sigmoid(torch.randn(num_tokens, num_v_heads, device="cuda", generator=gen))
    state = torch.randn(NUM_SLOTS, num_v_heads, HEAD_DIM, HEAD_DIM, device="cuda", generator=gen) * 0.5
    return q, k, v, g, beta, state


def _check_chunk(lengths: tuple[int, ...], slots: list[int], shape: str, seed: int) -> None:
    q, k, v, g, beta, state = _inputs(sum(lengths), shape, seed)
    initial = state.clone()
    expected_state = state.clone()
    slot_ids = torch.tensor(slots, device="cuda")
    out = chunk_gated_delta_rule(q, k, v, g, beta, state, slot_ids, lengths)
    expected = ref.chunk_gated_delta_rule(q, k, v, g, beta, expected_state, slot_ids, lengths)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    start = 0
    for slot, length in zip(slots, lengths):
        rows = slice(start, start + length)
        out_err = _relative_error(out[rows], expected[rows])
        state_err = _relative_error(state[slot], expected_state[slot])
        assert out_err < CHUNK_OUT_REL, (length, out_err)
        assert state_err < CHUNK_STATE_REL, (length, state_err)
        start += length
    for slot in set(range(NUM_SLOTS)) - set(slots):
        assert torch.equal(state[slot], initial[slot]), f"slot {slot} belongs to nobody but changed"


@pytest.mark.parametrize("length", [1, 63, 64, 65, 1000])
def test_chunk_single_request_from_a_nonzero_state(length: int) -> None:
    _check_chunk((length,), [6], "27B", seed=length)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_chunk_padded_to_a_captured_shape_matches_the_reference(shape: str) -> None:
    """A step padded to a step graph's shape: rows before the first request and after the last
    belong to none (a rule's second pass), empty requests on the scratch slot, the chunk list
    padded with chunks of the last (empty) request; the same as the requests run alone, and run
    from a CUDA graph whose offsets change between replays."""
    from ninfer.models.padded_step import PaddedStep

    scratch, num_tokens, rows = 8, 256, 5
    max_chunks = PaddedStep.max_chunks(num_tokens, rows)
    q, k, v, g, beta, state = _inputs(num_tokens, shape, seed=21)

    def metadata(starts: list[int], slots: list[int]):
        lengths = [hi - lo for lo, hi in zip(starts, starts[1:])]
        counts = [-(-n // 64) for n in lengths]
        chunks = [[b, c] for b, n in enumerate(counts) for c in range(n)]
        chunks += [[rows - 1, 0]] * (max_chunks - len(chunks))
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device="cuda")  # noqa: E731
        return as_tensor(slots), as_tensor(starts), as_tensor(chunks), as_tensor(offsets)

    cases = [([10, 10, 75, 76, 200, 200], [2, 5, 0, 3, scratch]),
             ([0, 130, 131, 131, 131, 131], [7, 1, scratch, scratch, scratch])]
    static = [t.clone() for t in metadata(*cases[0])]
    graph_state = state.clone()
    graph = torch.cuda.CUDAGraph()
    chunk_gated_delta_rule_padded(q, k, v, g, beta, state.clone(), *static)  # compile outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        replayed = chunk_gated_delta_rule_padded(q, k, v, g, beta, graph_state, *static)
    for starts, slots in cases:
        eager_state, expected_state = state.clone(), state.clone()
        for buffer, value in zip(static, metadata(starts, slots), strict=True):
            buffer.copy_(value)
        graph_state.copy_(state)
        graph.replay()
        out = chunk_gated_delta_rule_padded(q, k, v, g, beta, eager_state, *metadata(starts, slots))
        expected = ref.chunk_gated_delta_rule_padded(q, k, v, g, beta, expected_state, *metadata(starts, slots))
        for b, slot in enumerate(slots):
            rows_of = slice(starts[b], starts[b + 1])
            if starts[b + 1] > starts[b]:
                assert _relative_error(out[rows_of], expected[rows_of]) < CHUNK_OUT_REL
                assert _relative_error(eager_state[slot], expected_state[slot]) < CHUNK_STATE_REL
                assert torch.equal(replayed[rows_of], out[rows_of])
        written = {slot for b, slot in enumerate(slots) if starts[b + 1] > starts[b]}
        for slot in set(range(NUM_SLOTS)) - written:
            assert torch.equal(eager_state[slot], state[slot]), f"slot {slot} belongs to nobody but changed"
        assert torch.equal(graph_state, eager_state)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_chunk_varlen_batch_in_noncontiguous_slots(shape: str) -> None:
    _check_chunk((65, 1, 1000, 64, 63), [5, 0, 8, 2, 3], shape, seed=7)


def test_varlen_metadata_matches_fla() -> None:
    """Our once-per-step chunk_indices and chunk_offsets are fla's (its prepare_chunk_indices and
    prepare_chunk_offsets)."""
    from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

    from ninfer.kernels.gated_delta_rule.triton import FLA_CHUNK_SIZE, _varlen_metadata

    lengths = (65, 1, 1000, 64, 63)
    cu_seqlens, chunk_indices, chunk_offsets = _varlen_metadata(lengths, torch.device("cuda"))
    assert torch.equal(chunk_indices, prepare_chunk_indices(cu_seqlens, FLA_CHUNK_SIZE))
    assert torch.equal(chunk_offsets, prepare_chunk_offsets(cu_seqlens, FLA_CHUNK_SIZE))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch", [1, 8])
def test_recurrent_decode_matches_reference(shape: str, batch: int) -> None:
    q, k, v, g, beta, state = _inputs(batch, shape, seed=100 + batch)
    slots = torch.tensor([8, 1, 4, 0, 7, 2, 5, 3][:batch], device="cuda")
    initial = state.clone()
    expected_state = state.clone()
    lengths = (1,) * batch
    out = recurrent_gated_delta_rule(q, k, v, g, beta, state, slots, lengths)
    expected = ref.recurrent_gated_delta_rule(q, k, v, g, beta, expected_state, slots, lengths)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-4)
    if batch == 1:
        assert torch.equal(state[6], initial[6])


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch", [1, 8])
def test_gates_in_the_recurrent_kernel_equal_the_gates_kernel_then_the_rule(shape: str, batch: int) -> None:
    """The decode form that computes the gates itself = gdn_gates + recurrent rule (same fp32 math)."""
    q, k, v, _, _, state = _inputs(batch, shape, seed=200 + batch)
    num_v_heads = v.shape[1]
    gen = torch.Generator("cuda").manual_seed(batch)
    packed = (torch.randn(batch, 2 * num_v_heads + 8, device="cuda", generator=gen) * 3).bfloat16()
    b, a = packed[:, 8 : 8 + num_v_heads], packed[:, 8 + num_v_heads :]
    A_log = (torch.rand(num_v_heads, device="cuda", generator=gen) * 4 - 2).bfloat16()
    dt_bias = torch.randn(num_v_heads, device="cuda", generator=gen).bfloat16()
    slots = torch.tensor([8, 1, 4, 0, 7, 2, 5, 3][:batch], device="cuda")
    two_step_state = state.clone()
    lengths = (1,) * batch
    out = recurrent_gated_delta_rule_with_gates(q, k, v, a, b, A_log, dt_bias, state, slots, lengths)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    expected = recurrent_gated_delta_rule(q, k, v, g, beta, two_step_state, slots, lengths)
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(state, two_step_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch", [1, 8])
def test_verify_rows_store_the_raw_gates(shape: str, batch: int) -> None:
    """Speculative verification rows (4 a request, update_state=False) with gates_out, one layer's
    rows of a [layers, rows, 2*Hv] scratch: a | b stored as loaded, once per row and head whatever
    the column strips (16 columns at batch 1), outputs as the reference's, no slot written."""
    rows, lengths = 4 * batch, (4,) * batch
    q, k, v, _, _, state = _inputs(rows, shape, seed=300 + batch)
    num_v_heads = v.shape[1]
    gen = torch.Generator("cuda").manual_seed(batch)
    packed = (torch.randn(rows, 2 * num_v_heads + 8, device="cuda", generator=gen) * 3).bfloat16()
    b, a = packed[:, 8 : 8 + num_v_heads], packed[:, 8 + num_v_heads :]  # the layer's order: b, then a
    A_log = (torch.rand(num_v_heads, device="cuda", generator=gen) * 4 - 2).bfloat16()
    dt_bias = torch.randn(num_v_heads, device="cuda", generator=gen).bfloat16()
    slots = torch.tensor([8, 1, 4, 0, 7, 2, 5, 3][:batch], device="cuda")
    initial = state.clone()
    gates = torch.full((3, rows + 4, 2 * num_v_heads), 7.0, device="cuda").bfloat16()
    out = recurrent_gated_delta_rule_with_gates(
        q, k, v, a, b, A_log, dt_bias, state, slots, lengths, False, gates_out=gates[1, :rows]
    )
    expected = ref.recurrent_gated_delta_rule_with_gates(
        q, k, v, a, b, A_log, dt_bias, initial.clone(), slots, lengths, False
    )
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(gates[1, :rows], torch.cat((a, b), dim=-1))
    assert (gates[[0, 2]] == 7.0).all() and (gates[1, rows:] == 7.0).all()
    assert torch.equal(state, initial)


def test_prefill_then_decode_continues_the_sequence() -> None:
    """fla chunk over 100 tokens, then 3 decode steps of our kernel == the reference over 103."""
    q, k, v, g, beta, state = _inputs(103, "35B-A3B", seed=3)
    slot = torch.tensor([4], device="cuda")
    expected_state = state.clone()
    expected = ref.chunk_gated_delta_rule(q, k, v, g, beta, expected_state, slot, (103,))
    pieces = [chunk_gated_delta_rule(q[:100], k[:100], v[:100], g[:100], beta[:100], state, slot, (100,))]
    for t in range(100, 103):
        rows = slice(t, t + 1)
        pieces.append(recurrent_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], state, slot, (1,)))
    assert _relative_error(torch.cat(pieces), expected) < CHUNK_OUT_REL
    assert _relative_error(state[4], expected_state[4]) < CHUNK_STATE_REL


@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_step_replays_in_a_cuda_graph(shape: str) -> None:
    """conv update + recurrent rule captured once, replayed on new inputs == eager, bit for bit."""
    num_k_heads, num_v_heads = SHAPES[shape]
    key_dim, value_dim = num_k_heads * HEAD_DIM, num_v_heads * HEAD_DIM
    conv_dim = 2 * key_dim + value_dim
    batch = 8
    gen = torch.Generator("cuda").manual_seed(11)
    weight = (torch.randn(conv_dim, 4, device="cuda", generator=gen) * 0.5).bfloat16()
    conv_state = torch.randn(NUM_SLOTS, conv_dim, 3, device="cuda", generator=gen).bfloat16()
    rec_state = torch.randn(NUM_SLOTS, num_v_heads, HEAD_DIM, HEAD_DIM, device="cuda", generator=gen) * 0.5
    slots = torch.tensor([8, 1, 4, 0, 7, 2, 5, 3], device="cuda")
    x = torch.empty(batch, conv_dim, device="cuda", dtype=torch.bfloat16)
    g = torch.empty(batch, num_v_heads, device="cuda")
    beta = torch.empty(batch, num_v_heads, device="cuda")

    def step() -> torch.Tensor:
        qkv = causal_conv1d_update(x, weight, conv_state, slots)
        q, k, v = qkv.split([key_dim, key_dim, value_dim], dim=-1)
        return recurrent_gated_delta_rule(
            q.reshape(batch, num_k_heads, HEAD_DIM),
            k.reshape(batch, num_k_heads, HEAD_DIM),
            v.reshape(batch, num_v_heads, HEAD_DIM),
            g,
            beta,
            rec_state,
            slots,
            (1,) * batch,
        )

    def new_inputs(seed: int) -> None:
        gen = torch.Generator("cuda").manual_seed(seed)
        x.copy_(torch.randn(batch, conv_dim, device="cuda", generator=gen))
        g.copy_(-torch.rand(batch, num_v_heads, device="cuda", generator=gen))
        beta.copy_(torch.rand(batch, num_v_heads, device="cuda", generator=gen))

    start_conv, start_rec = conv_state.clone(), rec_state.clone()
    new_inputs(0)
    step()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    eager_results, graph_results = [], []
    for results, run in ((eager_results, step), (graph_results, lambda: (graph.replay(), static_out)[1])):
        conv_state.copy_(start_conv)
        rec_state.copy_(start_rec)
        for seed in (1, 2, 3):
            new_inputs(seed)
            results.append((run().clone(), conv_state.clone(), rec_state.clone()))
    torch.cuda.synchronize()
    for (out_e, conv_e, rec_e), (out_g, conv_g, rec_g) in zip(eager_results, graph_results):
        assert torch.equal(out_g, out_e)
        assert torch.equal(conv_g, conv_e)
        assert torch.equal(rec_g, rec_e)
    assert not torch.equal(eager_results[0][2], eager_results[2][2])  # the steps really advanced the state


def random_gated_deltanet(config, state_layer_index: int):
    """A bf16 GatedDeltaNet layer on the GPU with seeded random weights in the ranges a checkpoint's
    hold (A_log in [-1, 1.5], norms and biases near 1)."""
    from ninfer.models.layers.gated_deltanet import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(config, state_layer_index=state_layer_index).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5)
            elif name == "A_log":
                param.uniform_(-1.0, 1.5)
            else:
                param.normal_(1.0, 0.2)
    return layer


def test_layer_prefill_and_graph_decode_match_reference_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GatedDeltaNet layer (35B-A3B shape) on the fast ops: a varlen prefill, then decode
    steps replayed from one CUDA graph, against the same layer on the reference ops."""
    from ninfer.models.config import ModelConfig
    from ninfer.models.forward_batch import ForwardBatch
    from ninfer.models.state_cache import StateCache

    num_k_heads, num_v_heads = SHAPES["35B-A3B"]
    config = ModelConfig(
        model_type="qwen3_5_moe_text",
        family="qwen3_5",
        vocab_size=32,
        hidden_size=2048,
        num_hidden_layers=1,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        intermediate_size=0,
        linear_num_key_heads=num_k_heads,
        linear_num_value_heads=num_v_heads,
    )
    layer = random_gated_deltanet(config, state_layer_index=0)

    def cache() -> StateCache:
        states = StateCache.allocate(
            1, 6, config.linear_conv_dim, 4, num_v_heads, HEAD_DIM, HEAD_DIM, torch.bfloat16, "cuda"
        )
        return states

    fast_cache, ref_cache = cache(), cache()
    lengths, slots = [37, 90], [4, 1]
    page_table = torch.zeros(2, 1, dtype=torch.int32)

    def batch(states: StateCache, query_lens: list[int], computed: list[int]) -> ForwardBatch:
        return ForwardBatch.build(query_lens, computed, page_table, slots, None, states, device="cuda")

    x = torch.randn(sum(lengths), 2048, device="cuda").bfloat16()
    with torch.no_grad():
        fast = layer(x, batch(fast_cache, lengths, [0, 0]))
        monkeypatch.setenv("NINFER_KERNELS", "ref")
        expected = layer(x, batch(ref_cache, lengths, [0, 0]))
        monkeypatch.delenv("NINFER_KERNELS")
    assert _relative_error(fast, expected) < CHUNK_OUT_REL
    assert _relative_error(fast_cache.recurrent, ref_cache.recurrent) < CHUNK_STATE_REL
    assert torch.equal(fast_cache.conv, ref_cache.conv)

    decode_x = torch.empty(2, 2048, device="cuda", dtype=torch.bfloat16)
    fast_batch = batch(fast_cache, [1, 1], lengths)
    saved = fast_cache.conv.clone(), fast_cache.recurrent.clone()
    with torch.no_grad():
        decode_x.normal_()
        layer(decode_x, fast_batch)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(decode_x, fast_batch)
    fast_cache.conv.copy_(saved[0])
    fast_cache.recurrent.copy_(saved[1])
    for step in range(3):
        new = torch.randn(2, 2048, device="cuda").bfloat16()
        decode_x.copy_(new)
        graph.replay()
        with torch.no_grad():
            monkeypatch.setenv("NINFER_KERNELS", "ref")
            expected = layer(new, batch(ref_cache, [1, 1], [n + step for n in lengths]))
            monkeypatch.delenv("NINFER_KERNELS")
        assert _relative_error(static_out, expected) < CHUNK_OUT_REL
    assert _relative_error(fast_cache.recurrent, ref_cache.recurrent) < CHUNK_STATE_REL
    # The conv state holds in_proj outputs; at decode the fast path projects with our GEMV and
    # the reference with ref.gemv, so they differ by fp32 summation order (the conv kernels
    # themselves copy inputs into the state exactly: tests/gpu/test_causal_conv1d.py).
    assert_matches(fast_cache.conv, ref_cache.conv)
