"""Speculative rounds on the GPU: the commit kernels at the real shapes and in a graph, and
VerifyGraphs replay against the eager speculative path, through the real engine.

- commit_gated_delta_rule / commit_conv_state (Triton) against ref.py at the 27B and
  35B-A3B Gated DeltaNet shapes, then captured: replay equals eager bit for bit;
- the verification pass that fills the scratch (the conv writing its output and inputs there,
  the rule its raw gates) captured and replayed like eager, and through a GatedDeltaNet layer:
  the scratch holds the layer's own projection rows and their conv, no slot written;
- a tiny random bf16 Qwen3.5 with an MTP head: an engine whose speculative rounds replay
  the verify graphs and one that runs them eagerly (--no-cuda-graph) step in lockstep on
  greedy and seeded sampled requests; every delta and the per-slot logits must be equal bit
  for bit (the same kernels at the same sizes), and the graphs must have served the rounds;
- in fp32, speculative greedy output equals plain decoding's;
- the table oracle (the MTP head's work, proposals from the known continuation) is accepted
  in full through the graphs.
"""

from __future__ import annotations

import functools

import pytest
import torch

from ninfer.artifact import open_artifact
from ninfer.config import EngineConfig
from ninfer.contract.request import EngineRequest
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.engine.speculative.proposal_head import ProposalHead
from ninfer.kernels.causal_conv1d import causal_conv1d, commit_conv_state
from ninfer.kernels.causal_conv1d import ref as conv_ref
from ninfer.kernels.gated_delta_rule import commit_gated_delta_rule, recurrent_gated_delta_rule_with_gates
from ninfer.kernels.gated_delta_rule import ref as gdn_ref
from ninfer.models.config import ModelConfig
from ninfer.models.forward_batch import ForwardBatch
from ninfer.models.state_cache import StateCache
from ninfer.models.verify_scratch import VerifyRows, VerifyScratch
from ninfer.testing.oracle_drafter import TableOracleDrafter
from tests.gpu.test_gated_delta_rule import random_gated_deltanet
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.engine.test_verify_graphs import count_rounds
from tests.gpu.graph_replay import assert_replay_equals_eager

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEAD_DIM = 128
SHAPES = {"27B": (16, 48), "35B-A3B": (16, 32)}  # (Hk, Hv)
NUM_LAYERS, NUM_SLOTS, CONV_KERNEL = 3, 9, 4
SLOTS, STARTS = [7, 0, 4, 2], [0, 8, 4, 12]  # out of order; 4 rows per request (K = 3)
COUNTS = [1, 4, 2, 3]


def _commit_inputs(shape: str, seed: int):
    num_k_heads, num_v_heads = SHAPES[shape]
    gen = torch.Generator("cuda").manual_seed(seed)
    conv_dim = (2 * num_k_heads + num_v_heads) * HEAD_DIM
    rows = 4 * len(SLOTS)
    return {
        "mixed": torch.randn(NUM_LAYERS, rows, conv_dim, device="cuda", generator=gen).bfloat16(),
        "gates": (torch.randn(NUM_LAYERS, rows, 2 * num_v_heads, device="cuda", generator=gen) * 3).bfloat16(),
        "a_log": torch.rand(NUM_LAYERS, num_v_heads, device="cuda", generator=gen).log1p(),
        "dt_bias": torch.randn(NUM_LAYERS, num_v_heads, device="cuda", generator=gen),
        "state": torch.randn(NUM_LAYERS, NUM_SLOTS, num_v_heads, HEAD_DIM, HEAD_DIM, device="cuda", generator=gen) * 0.3,
        "conv_x": torch.randn(NUM_LAYERS, rows, conv_dim, device="cuda", generator=gen).bfloat16(),
        "conv_state": torch.randn(NUM_LAYERS, NUM_SLOTS, conv_dim, CONV_KERNEL - 1, device="cuda", generator=gen).bfloat16(),
        "slots": torch.tensor(SLOTS, device="cuda"),
        "starts": torch.tensor(STARTS, device="cuda"),
        "counts": torch.tensor(COUNTS, device="cuda"),
    }


@pytest.mark.parametrize("shape", list(SHAPES))
def test_commit_kernels_match_the_reference_at_real_shapes(shape: str) -> None:
    num_k_heads = SHAPES[shape][0]
    fast, expected = _commit_inputs(shape, seed=1), _commit_inputs(shape, seed=1)
    initial = fast["state"].clone()
    args = lambda t: (t["slots"], t["starts"], t["counts"], num_k_heads, 4)  # noqa: E731
    commit_gated_delta_rule(fast["mixed"], fast["gates"], fast["a_log"], fast["dt_bias"], fast["state"], *args(fast))
    gdn_ref.commit_gated_delta_rule(
        expected["mixed"], expected["gates"], expected["a_log"], expected["dt_bias"], expected["state"], *args(expected)
    )
    # fp32 recurrences in another summation order: a few ulps of the state's scale.
    torch.testing.assert_close(fast["state"], expected["state"], atol=2e-5, rtol=2e-5)
    untouched = sorted(set(range(NUM_SLOTS)) - set(SLOTS))
    assert torch.equal(fast["state"][:, untouched], initial[:, untouched])
    commit_conv_state(fast["conv_x"], fast["conv_state"], fast["slots"], fast["starts"], fast["counts"], 4)
    conv_ref.commit_conv_state(
        expected["conv_x"], expected["conv_state"], expected["slots"], expected["starts"], expected["counts"], 4
    )
    assert torch.equal(fast["conv_state"], expected["conv_state"])


def test_commit_kernels_replay_like_eager() -> None:
    num_k_heads = SHAPES["27B"][0]

    def step(t):
        commit_gated_delta_rule(t["mixed"], t["gates"], t["a_log"], t["dt_bias"], t["state"], t["slots"], t["starts"],
                                t["counts"], num_k_heads, 4)
        commit_conv_state(t["conv_x"], t["conv_state"], t["slots"], t["starts"], t["counts"], 4)
        return [t["state"].clone(), t["conv_state"].clone()]

    def fresh(seed):
        inputs = _commit_inputs("27B", seed)
        inputs["counts"] = torch.tensor([1 + (seed + i) % 4 for i in range(len(SLOTS))], device="cuda")
        return inputs

    assert_replay_equals_eager(step, fresh)


def test_verification_pass_fills_the_scratch_and_replays_like_eager() -> None:
    """One layer's verification pass as GatedDeltaNet._verify_rows launches it (the conv into the
    scratch's post-conv and pre-conv rows, the rule from the post-conv rows storing the raw gates),
    captured once and replayed on new rows: outputs and scratch equal eager bit for bit, the scratch
    holds the rows' inputs exactly, and no slot is written."""
    num_k_heads, num_v_heads = SHAPES["27B"]
    key_dim, value_dim = num_k_heads * HEAD_DIM, num_v_heads * HEAD_DIM
    conv_dim, rows, lengths, layer = 2 * key_dim + value_dim, 4 * len(SLOTS), (4,) * len(SLOTS), 1
    gen = torch.Generator("cuda").manual_seed(5)
    weight = (torch.randn(conv_dim, CONV_KERNEL, device="cuda", generator=gen) * 0.5).bfloat16()
    conv_state = torch.randn(NUM_SLOTS, conv_dim, CONV_KERNEL - 1, device="cuda", generator=gen).bfloat16()
    state = torch.randn(NUM_SLOTS, num_v_heads, HEAD_DIM, HEAD_DIM, device="cuda", generator=gen) * 0.3
    a_log = torch.rand(num_v_heads, device="cuda", generator=gen).log1p()
    dt_bias = torch.randn(num_v_heads, device="cuda", generator=gen)
    scratch = VerifyScratch.allocate(NUM_LAYERS, rows + 4, conv_dim, num_v_heads, torch.bfloat16, "cuda")
    slots = torch.tensor(SLOTS, device="cuda")
    initial = conv_state.clone(), state.clone()

    def step(t):
        qkv, b, a = t["packed"].split([conv_dim, num_v_heads, num_v_heads], dim=-1)  # the layer's order
        mixed = causal_conv1d(
            qkv, weight, conv_state, slots, lengths, update_state=False, out=scratch.mixed[layer, :rows],
            inputs_out=scratch.conv_inputs[layer, :rows],
        )  # fmt: skip
        q, k, v = mixed.split([key_dim, key_dim, value_dim], dim=-1)
        out = recurrent_gated_delta_rule_with_gates(
            q.reshape(rows, num_k_heads, HEAD_DIM), k.reshape(rows, num_k_heads, HEAD_DIM),
            v.reshape(rows, num_v_heads, HEAD_DIM), a, b, a_log, dt_bias, state, slots, lengths, False,
            gates_out=scratch.gates[layer, :rows],
        )  # fmt: skip
        return [out, scratch.mixed.clone(), scratch.conv_inputs.clone(), scratch.gates.clone()]

    def fresh(seed):
        gen = torch.Generator("cuda").manual_seed(seed)
        return {"packed": torch.randn(rows, conv_dim + 2 * num_v_heads, device="cuda", generator=gen).bfloat16()}

    assert_replay_equals_eager(step, fresh)
    last = fresh(300)["packed"]  # the eager step ran last, on these rows
    assert torch.equal(scratch.conv_inputs[layer, :rows], last[:, :conv_dim])
    b, a = last[:, conv_dim:].split(num_v_heads, dim=-1)
    assert torch.equal(scratch.gates[layer, :rows], torch.cat((a, b), dim=-1))
    expected = conv_ref.causal_conv1d(last[:, :conv_dim], weight, initial[0], slots, lengths, update_state=False)
    torch.testing.assert_close(scratch.mixed[layer, :rows], expected, atol=1e-2, rtol=1e-2)
    assert torch.equal(conv_state, initial[0]) and torch.equal(state, initial[1])


def test_layer_verification_rows_fill_the_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GatedDeltaNet layer (27B heads; the second of two state layers) scoring 2 requests x 4
    verification rows on the fast ops: its scratch rows hold its in_proj's q|k|v and a|b exactly
    and their conv (the reference's to one bf16 rounding), the other layer's and later rows are not
    written, the slots keep their states, and the output is the reference layer's."""
    num_k_heads, num_v_heads = SHAPES["27B"]
    config = ModelConfig(
        model_type="qwen3_5_text", family="qwen3_5", vocab_size=32, hidden_size=2048, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, intermediate_size=0,
        linear_num_key_heads=num_k_heads, linear_num_value_heads=num_v_heads,
    )  # fmt: skip
    layer = random_gated_deltanet(config, state_layer_index=1)
    conv_dim, lengths, slots, rows = config.linear_conv_dim, [4, 4], [4, 1], 8
    states = StateCache.allocate(2, 6, conv_dim, 4, num_v_heads, HEAD_DIM, HEAD_DIM, torch.bfloat16, "cuda")
    states.conv.normal_()
    states.recurrent.normal_(0.0, 0.3)
    initial = states.conv.clone(), states.recurrent.clone()
    x = torch.randn(rows, 2048, device="cuda").bfloat16()

    def verify(cache: StateCache) -> tuple[torch.Tensor, VerifyScratch, torch.Tensor]:
        scratch = VerifyScratch.allocate(2, rows + 4, conv_dim, num_v_heads, torch.bfloat16, "cuda")
        for buffer in (scratch.conv_inputs, scratch.mixed, scratch.gates):
            buffer.fill_(7.0)
        batch = ForwardBatch.build(lengths, [30, 50], torch.zeros(2, 1, dtype=torch.int32), slots, None, cache,
                                   device="cuda")
        batch.verify = VerifyRows(len(lengths), rows, scratch)
        projected = []
        hook = layer.in_proj.register_forward_hook(lambda module, inputs, output: projected.append(output.clone()))
        with torch.no_grad():
            out = layer(x, batch)
        hook.remove()
        return out, scratch, projected[0]

    out, scratch, projected = verify(states)
    qkv, _, b, a = projected.split(layer.in_proj_sizes, dim=-1)
    assert torch.equal(scratch.conv_inputs[1, :rows], qkv)
    assert torch.equal(scratch.gates[1, :rows], torch.cat((a, b), dim=-1))
    expected_mixed = conv_ref.causal_conv1d(
        qkv, layer.conv1d.weight.squeeze(1), initial[0][1], torch.tensor(slots, device="cuda"), tuple(lengths),
        update_state=False,
    )  # fmt: skip
    torch.testing.assert_close(scratch.mixed[1, :rows], expected_mixed, atol=1e-2, rtol=1e-2)
    for buffer in (scratch.conv_inputs, scratch.mixed, scratch.gates):
        assert (buffer[0] == 7.0).all() and (buffer[1, rows:] == 7.0).all()
    assert torch.equal(states.conv, initial[0]) and torch.equal(states.recurrent, initial[1])

    monkeypatch.setenv("NINFER_KERNELS", "ref")
    ref_states = StateCache(initial[0].clone(), initial[1].clone())
    ref_out, ref_scratch, _ = verify(ref_states)
    monkeypatch.delenv("NINFER_KERNELS")
    # The projections differ by summation order (our GEMV against ref.gemv), the rest by fp32 order.
    relative = ((out.double() - ref_out.double()).norm() / ref_out.double().norm()).item()
    assert relative < 2e-2, relative
    torch.testing.assert_close(scratch.gates, ref_scratch.gates, atol=1e-2, rtol=1e-2)


# ---- the engine ----------------------------------------------------------------------
@functools.cache
def _artifact(root: str, dtype: str):
    artifact = open_artifact(str(make_tiny_qwen3_5(root, mtp=True, dtype=dtype)))
    return artifact, artifact.load_model(dtype=getattr(torch, dtype), device="cuda")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("verify-graph-artifacts"))


def _engine(root: str, dtype: str = "bfloat16", drafter=None, **overrides) -> EngineCore:
    artifact, model = _artifact(root, dtype)
    config = dict(max_concurrency=3, max_context=512, prefill_chunk=32, mixed_prefill_chunk=16, prefix_reuse=False,
                  spec="mtp", draft_tokens=3, decode_overlap=False, adaptive_drafts=False)
    return EngineCore(model, artifact.tokenizer, EngineConfig(**{**config, **overrides}), drafter=drafter)


def _requests(sampled_share: bool = True) -> dict[int, list[EngineRequest]]:
    greedy = SamplingParams(temperature=0.0)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=12, seed=1234) if sampled_share else greedy
    return {
        0: [EngineRequest("a", list(range(1000, 1040)), greedy, max_new_tokens=40),
            EngineRequest("b", list(range(2000, 2025)), sampled, max_new_tokens=33)],
        6: [EngineRequest("c", list(range(5000, 5090)), greedy, max_new_tokens=27)],
    }


def _run(core: EngineCore, arrivals, lockstep: EngineCore | None = None, max_steps: int = 2000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for step in range(max_steps):
        for request in arrivals.get(step, []):
            tokens[request.request_id] = []
            core.add_request(request)
            if lockstep is not None:
                lockstep.add_request(request)
        if step > max(arrivals) and not core.has_work:
            return tokens
        outs = core.step()
        assert core.failed is None
        if lockstep is not None:
            others = lockstep.step()
            assert [(o.request_id, o.new_token_ids) for o in outs] == [(o.request_id, o.new_token_ids) for o in others]
            assert torch.equal(core.runner.slot_logits, lockstep.runner.slot_logits), f"step {step}"
        for out in outs:
            tokens[out.request_id].extend(out.new_token_ids)
    raise AssertionError("the engine did not finish")


def _count_rounds(core: EngineCore) -> list[int]:
    graphs = core.runner.verify_graphs
    assert graphs is not None, "verify graphs were not captured"
    return count_rounds(graphs)


def test_verify_graph_rounds_equal_eager_rounds_bit_for_bit(root) -> None:
    graphed = _engine(root)
    assert sorted(graphed.runner.verify_graphs.forward_graphs) == [1, 2, 3]
    rounds = _count_rounds(graphed)
    eager = _engine(root, cuda_graphs=False)
    assert eager.runner.verify_graphs is None
    tokens = _run(graphed, _requests(), lockstep=eager)
    assert {1, 2, 3} <= set(rounds), rounds
    assert all(len(t) > 10 for t in tokens.values())


def test_penalized_rounds_replay_like_eager(root) -> None:
    """Presence and frequency penalties inside the verify graphs (the counts built on the device
    from the uploaded output tokens and the drafts) against eager rounds, bit for bit."""
    repeat = SamplingParams(temperature=0.0, presence_penalty=-1.0, frequency_penalty=0.3)
    sampled = SamplingParams(temperature=0.8, top_k=12, presence_penalty=1.5, seed=7)
    arrivals = {
        0: [EngineRequest("a", list(range(1000, 1040)), repeat, max_new_tokens=40),
            EngineRequest("b", list(range(2000, 2025)), sampled, max_new_tokens=33)],
        6: [EngineRequest("c", list(range(5000, 5090)), SamplingParams(temperature=0.0), max_new_tokens=27)],
    }
    graphed = _engine(root)
    rounds = _count_rounds(graphed)
    eager = _engine(root, cuda_graphs=False)
    tokens = _run(graphed, arrivals, lockstep=eager)
    assert {1, 2, 3} <= set(rounds), rounds
    assert all(len(t) > 10 for t in tokens.values())


def test_fp8_drafter_rounds_replay_like_eager(root) -> None:
    """--draft-fp8: the MTP head's layers and the reduced proposal head in FP8, through the verify
    graphs and eagerly, bit for bit (greedy equality with plain decoding: the CPU engine tests)."""
    graphed = _engine(root, draft_fp8=True, lm_head_draft=True)
    assert graphed.runner.speculator.drafter.head.fp8 is not None
    rounds = _count_rounds(graphed)
    eager = _engine(root, draft_fp8=True, lm_head_draft=True, cuda_graphs=False)
    tokens = _run(graphed, _requests(), lockstep=eager)
    assert {1, 2, 3} <= set(rounds), rounds
    assert all(len(t) > 10 for t in tokens.values())


def test_the_engine_times_its_own_round_for_the_draft_policy(root) -> None:
    """Once captured, a batch-1 verify round is timed against a plain decode round; the adaptive
    policy's costs start from that ratio (the bit-for-bit test above runs after such a timing)."""
    core = _engine(root, adaptive_drafts=True)
    measured = core.runner.verify_graphs.round_cost_ratio
    assert measured is not None and 1.0 < measured < 10.0
    costs = core.scheduler.limits.round_costs
    assert costs.ratio(3, 4096) == pytest.approx(max(1.0, measured))


def test_speculative_greedy_equals_plain_decoding_in_fp32(root) -> None:
    plain = _run(_engine(root, "float32", spec=None, draft_tokens=None), _requests(sampled_share=False))
    core = _engine(root, "float32")
    rounds = _count_rounds(core)
    spec = _run(core, _requests(sampled_share=False))
    assert rounds
    assert spec == plain


def _run_alone(core: EngineCore, request: EngineRequest):
    """-> (the request's tokens, its final output's speculative counters), run alone in core."""
    tokens, counters = [], None
    core.add_request(request)
    while core.has_work:
        for out in core.step():
            tokens.extend(out.new_token_ids)
            if out.finished:
                counters = out.speculative
    return tokens, counters


def test_the_table_oracle_is_accepted_in_full_through_the_graphs(root) -> None:
    """The continuation comes from the speculative engine itself (its verification path's
    greedy tokens; plain decoding runs other kernels), then the table oracle proposes it."""
    artifact, model = _artifact(root, "bfloat16")
    prompt = list(range(3000, 3033))
    greedy = SamplingParams(temperature=0.0)
    arrivals = {0: [EngineRequest("x", prompt, greedy, max_new_tokens=60)]}
    expected = _run(_engine(root), arrivals)["x"]
    table = torch.tensor(prompt + expected, device="cuda").expand(8, -1).contiguous()
    head = ProposalHead(model.lm_head, artifact.tokenizer.vocab_size, reduced=False)
    core = _engine(root, drafter=TableOracleDrafter(model, head, 3, table))
    rounds = _count_rounds(core)
    finals, counters = _run_alone(core, arrivals[0][0])
    assert finals == expected
    assert counters.accepted_tokens == counters.drafted_tokens > 0
    # Four tokens a round once drafting starts: 60 tokens in 16 rounds, not 60.
    assert 14 <= len(rounds) <= 17, rounds


def test_adaptive_rounds_switch_between_graphs_like_eager(root) -> None:
    """With adaptive drafts and the random MTP head (drafts mostly rejected), requests fall back to
    plain rounds: those replay the decode graphs, which extend the drafter's context; speculative
    rounds (the first ones, probes) replay the verify graphs. Lockstep with the eager engine."""
    graphed = _engine(root, adaptive_drafts=True)
    verify_rounds = _count_rounds(graphed)
    decode_rounds: list[int] = []
    run = graphed.runner.graphs.run

    def counted(chunks, previous_ids=None, **options):
        decode_rounds.append(len(chunks))
        return run(chunks, previous_ids, **options)

    graphed.runner.graphs.run = counted
    eager = _engine(root, cuda_graphs=False, adaptive_drafts=True)
    tokens = _run(graphed, _requests(), lockstep=eager)
    assert verify_rounds and decode_rounds, (verify_rounds, decode_rounds)
    assert all(len(t) > 10 for t in tokens.values())
    # The drafter's context after the plain rounds is the same as the eager path's.
    speculator, eager_speculator = graphed.runner.speculator, eager.runner.speculator
    assert torch.equal(speculator.slot_hidden, eager_speculator.slot_hidden)
