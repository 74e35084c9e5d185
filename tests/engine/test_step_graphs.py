"""Prompt and mixed steps padded to a step graph's bucket (engine/step_graphs.py) compute what the
eager step computes, on the CPU: the static buffers, the empty requests and rows of none, the rule's
two passes around a checkpoint inside the step and the chained rows, run uncaptured (the captured
graphs are compared with eager steps in tests/gpu/test_step_graphs.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ninfer.artifact import open_artifact
from ninfer.config import EngineConfig
from ninfer.contract.request import CaptureHint, EngineRequest
from ninfer.contract.reuse_path import ReusePath
from ninfer.contract.sampling import SamplingParams
from ninfer.engine import core as engine_core
from ninfer.engine.core import EngineCore
from ninfer.engine.runner import ModelRunner
from ninfer.engine.scheduler import ResetSlot, ScheduledChunk, SchedulerStep, StepKind, chunks
from ninfer.engine.step_graphs import StepGraphs, token_buckets
from ninfer.kernels.moe.kernel_choice import FP8_GROUPED_MM_MIN_PAIRS, tile_rows, token_switches
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.gpu.test_cuda_graphs import ARCHITECTURES, _model
from tests.unit.conftest import make_byte_tokenizer

GREEDY = SamplingParams(temperature=0.0, seed=0)
PAGE_SIZE = 16
PAGES_PER_REQUEST = 16  # 256 tokens each
NUM_SLOTS = 7


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("step-graph-models"))


def chunk(index: int, tokens: list[int], num_computed: int, **fields) -> ScheduledChunk:
    pages = list(range(index * PAGES_PER_REQUEST, (index + 1) * PAGES_PER_REQUEST))
    return ScheduledChunk(f"r{index}", tokens, num_computed, pages, index, compute_logits=True, sample=True,
                          sampling=GREEDY, num_generated=0, output_token_ids=[], **fields)


def tokens(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runners(model, step_graph_tokens: int = 200, max_batch: int = 4) -> tuple[ModelRunner, ModelRunner]:
    """(padded, eager) over the same model, slots starting from zero state."""
    make = lambda tokens: ModelRunner(  # noqa: E731
        model, NUM_SLOTS * PAGES_PER_REQUEST, PAGE_SIZE, num_state_slots=NUM_SLOTS, max_batch=max_batch,
        step_graph_tokens=tokens,
    )
    padded, eager = make(step_graph_tokens), make(0)
    assert padded.step_graphs is not None and eager.step_graphs is None
    for runner in (padded, eager):
        runner.execute(SchedulerStep(StepKind.PREFILL, [], before=[ResetSlot(s) for s in range(NUM_SLOTS)]))
    return padded, eager


def _assert_same_caches(padded: ModelRunner, eager: ModelRunner, slots: list[int], what: str) -> None:
    # MoE: the reference's expert products run at each expert's row count, which the padding
    # rows change, and the CPU's small-row matmuls round differently by row count (fp32 noise).
    atol = 5e-5 if padded.model.config.is_moe else 1e-5
    pages = torch.tensor([p for s in slots for p in chunk(s, [], 0).page_ids])
    pairs = [("logits", padded.slot_logits[slots], eager.slot_logits[slots]),
             ("keys", padded.kv_cache.k[:, pages], eager.kv_cache.k[:, pages]),
             ("values", padded.kv_cache.v[:, pages], eager.kv_cache.v[:, pages])]
    if eager.state_cache is not None:
        for name in ("conv", "recurrent"):
            got, want = getattr(padded.state_cache, name), getattr(eager.state_cache, name)
            pairs.append((name, got[:, slots], want[:, slots]))
    for name, got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{what}, {name}: {m}")


class _Runs(list):
    """The token count of every padded step run, and how many had chained rows or checkpoints."""

    chained = snapshots = 0


def _count_runs(graphs: StepGraphs) -> _Runs:
    runs = _Runs()
    run = graphs.run

    def counted(chunks, previous_ids):
        runs.append(sum(len(c.token_ids) for c in chunks))
        runs.chained += any(c.previous_row is not None for c in chunks)
        runs.snapshots += any(c.snapshot_slot is not None for c in chunks)
        return run(chunks, previous_ids)

    graphs.run = counted
    return runs


def test_a_bucket_ends_where_the_layers_leave_the_gemv(tmp_root):
    """16-bit layers run the GEMV up to 16 rows and a matmul above: a prompt of up to 16 tokens
    pads to 16, so its padded step runs its eager step's products."""
    model = _model("qwen3_5", tmp_root, torch.float32, "cpu")
    padded, _ = _runners(model)
    assert padded.step_graphs.buckets == [16, 32, 64, 128, 200]


def test_token_buckets() -> None:
    assert token_buckets(1032) == [16, 32, 64, 128, 256, 512, 1024, 1032]
    assert token_buckets(64) == [16, 32, 64]
    assert token_buckets(10) == [10]
    # A bucket where the GEMV hands over to the matmul: a padded step runs its eager kernels.
    assert token_buckets(1024, (24,)) == [16, 24, 32, 64, 128, 256, 512, 1024]
    assert token_buckets(24, (32,)) == [16, 24]


def test_three_half_buckets_from_256(monkeypatch) -> None:
    from ninfer.engine import step_graphs

    monkeypatch.setattr(step_graphs, "THREE_HALF_BUCKETS", True)
    assert token_buckets(1024) == [16, 32, 64, 128, 256, 384, 512, 768, 1024]
    assert token_buckets(2048, (24,)) == [16, 24, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
    assert token_buckets(700) == [16, 32, 64, 128, 256, 384, 512, 700]


def test_a_full_mixed_step_fills_a_served_bucket() -> None:
    from ninfer.engine.scheduler import SchedulerLimits

    config = EngineConfig(max_concurrency=8, cuda_graphs=True, step_graphs=True)  # 8192 / 512 budgets
    buckets = token_buckets(config.step_graph_tokens)
    assert buckets[-1] == 1024 and all(b & (b - 1) == 0 for b in buckets)  # 1,024-token prompt steps too
    limits = SchedulerLimits(8, 4096, config.prefill_chunk, mixed_prefill_chunk=config.mixed_prefill_chunk)
    assert 8 + limits.mixed_prompt_budget(8) == 512 and 512 in buckets  # 8 decode rows and 504 prompt tokens: no padding
    wider = dataclasses.replace(config, mixed_prefill_chunk=1024)
    limits = SchedulerLimits(8, 4096, wider.prefill_chunk, mixed_prefill_chunk=wider.mixed_prefill_chunk)
    assert wider.step_graph_tokens == 1024 and 8 + limits.mixed_prompt_budget(8) == 1024
    assert dataclasses.replace(config, mixed_prefill_chunk=4096).step_graph_tokens == 2048  # larger steps run eagerly
    assert dataclasses.replace(config, step_graphs=False).step_graph_tokens == 0


@pytest.mark.parametrize(("num_experts", "top_k"), [(8, 2), (256, 8), (512, 10), (128, 8)])
def test_moe_buckets_hold_token_counts_that_choose_the_same_expert_kernels(num_experts: int, top_k: int) -> None:
    """Padded to its bucket, a step's experts run in the eager step's mode, block rows and
    grouped-GEMM choice (the tiles follow from the block rows), whatever its token count."""
    max_tokens = 8192
    buckets = token_buckets(max_tokens, token_switches(num_experts, top_k))

    def choice(num_tokens: int) -> tuple:
        num_pairs = num_tokens * top_k
        return tile_rows(num_pairs, num_experts), num_pairs >= FP8_GROUPED_MM_MIN_PAIRS

    for num_tokens in range(1, max_tokens + 1):
        bucket = next(b for b in buckets if b >= num_tokens)
        assert choice(bucket) == choice(num_tokens), (num_tokens, bucket)
    # Without the switches, some count would pad into another choice (the check above can fail).
    plain = token_buckets(max_tokens)
    assert any(choice(next(b for b in plain if b >= t)) != choice(t) for t in range(1, max_tokens + 1))


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_a_padded_mixed_step_equals_the_eager_step(arch, tmp_root):
    model = _model(arch, tmp_root, torch.float32, "cpu")
    padded, eager = _runners(model)
    runs = _count_runs(padded.step_graphs)
    histories = {i: tokens(i, 30 + 17 * i) for i in range(4)}  # requests 0..3 hold a cache; 4, 5 start
    for i, prompt in histories.items():  # 30..81 tokens: buckets 32, 64, 128
        for runner in (padded, eager):
            runner.execute(SchedulerStep(StepKind.PREFILL, [chunk(i, prompt, 0)]))
    mixed = [
        chunk(0, [7], len(histories[0])),  # decode rows at different contexts
        chunk(1, [8], len(histories[1])),
        chunk(4, tokens(40, 70), 0),  # a prompt's first chunk (two rule chunks)
        chunk(3, tokens(41, 37), len(histories[3])),  # a continuation chunk over cached context
        chunk(5, tokens(42, 1), 0),  # a one-token prompt
    ]
    assert padded.execute(SchedulerStep(StepKind.MIXED, mixed)) == eager.execute(SchedulerStep(StepKind.MIXED, mixed))
    assert runs == [30, 47, 64, 81, 110]
    _assert_same_caches(padded, eager, [0, 1, 3, 4, 5], "mixed step")


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_a_padded_step_with_a_checkpoint_inside_equals_the_eager_step(arch, tmp_root):
    """The rule's second pass (the rows past the frontier) starts from the state the first pass
    left, and the checkpoint's slot holds the state and logits at the frontier."""
    model = _model(arch, tmp_root, torch.float32, "cpu")
    padded, eager = _runners(model)
    runs = _count_runs(padded.step_graphs)
    decoding = tokens(1, 45)
    for runner in (padded, eager):
        runner.execute(SchedulerStep(StepKind.PREFILL, [chunk(1, decoding, 0)]))
    snapshotting = chunk(0, tokens(50, 140), 0, snapshot_tokens=133, snapshot_slot=6)
    step = [chunk(1, [7], len(decoding)), snapshotting, chunk(2, tokens(51, 9), 0, snapshot_tokens=4, snapshot_slot=5)]
    assert padded.execute(SchedulerStep(StepKind.MIXED, step)) == eager.execute(SchedulerStep(StepKind.MIXED, step))
    assert runs == [45, 150]
    _assert_same_caches(padded, eager, [0, 1, 2, 5, 6], "checkpoints inside the step")


def test_steps_a_bucket_cannot_hold_run_eagerly(tmp_root):
    model = _model("qwen3_5", tmp_root, torch.float32, "cpu")
    padded, eager = _runners(model, step_graph_tokens=64, max_batch=2)
    runs = _count_runs(padded.step_graphs)
    too_long = [chunk(0, tokens(60, 65), 0)]
    too_many = [chunk(i, tokens(61 + i, 3), 0, snapshot_tokens=1, snapshot_slot=6 - i) for i in range(3)]
    media = [dataclasses.replace(chunk(3, tokens(64, 3), 0), rope_positions=None, media=(object(),))]
    assert not padded.step_graphs.can_run(media)
    for step in (too_long, too_many):
        step_ids = [runner.execute(SchedulerStep(StepKind.PREFILL, step)) for runner in (padded, eager)]
        assert step_ids[0] == step_ids[1]
    assert runs == []  # 65 tokens > 64; 6 requests > max_batch + 2 continuations
    _assert_same_caches(padded, eager, [0, 1, 2, 4, 5, 6], "eager steps")


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_an_engine_with_step_graphs_generates_what_the_eager_engine_generates(arch, tmp_root, monkeypatch):
    """Through the engine: staggered greedy and sampled requests, prompt chunks beside decode rows
    chained to the previous step's ids (decode overlap), a checkpoint inside a prompt step."""
    model = _model(arch, tmp_root, torch.float32, "cpu")
    tokenizer = make_byte_tokenizer()
    runner_class = engine_core.ModelRunner

    def with_step_graphs(*args, step_graph_tokens: int = 0, **kwargs):
        return runner_class(*args, step_graph_tokens=80, **kwargs)

    config = EngineConfig(max_concurrency=3, prefill_chunk=48, mixed_prefill_chunk=24, max_context=192,
                          decode_overlap=True, log_stats_interval_ms=0)
    # The turn closure's snapshot inside a mixed step, which the scheduler leaves to frontiers with
    # many tokens after them: these prompts are short, and this is the padded step's case to check.
    monkeypatch.setattr(chunks, "MIN_TOKENS_AFTER_SNAPSHOT_BESIDE_DECODE", 0)
    eager = EngineCore(model, tokenizer, config)
    monkeypatch.setattr(engine_core, "ModelRunner", with_step_graphs)
    graph = EngineCore(model, tokenizer, config)
    runs = _count_runs(graph.runner.step_graphs)
    text = lambda s: [ord(c) for c in s]  # noqa: E731
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=12, seed=1234)
    prompt = text("A conversation with a turn closure inside it. " * 2)
    arrivals = {
        0: [EngineRequest("greedy", text("The quick brown fox jumps. " * 3), GREEDY, max_new_tokens=12)],
        2: [EngineRequest("sampled", text("Another prompt, sampled"), sampled, max_new_tokens=20)],
        5: [EngineRequest("turn", prompt, GREEDY, max_new_tokens=8,
                          capture_hints=[CaptureHint(len(prompt) - 5, ReusePath.PRIVATE_TURN_CLOSURE)])],
    }
    outputs, _ = _lockstep(graph, eager, arrivals)
    assert {rid: len(ids) for rid, ids in outputs.items()} == {"greedy": 12, "sampled": 20, "turn": 8}
    assert runs and runs.chained and runs.snapshots


def test_a_speculative_engine_with_step_graphs_computes_what_the_eager_engine_computes(tmp_root, monkeypatch):
    """Under --spec mtp, prompt steps (and the plain rows beside them) run the padded forward and
    the MTP head's pass follows from its hidden states: tokens, acceptance, the head's KV (a layer
    of the paged cache), the slots' hidden states and the drafts' distributions equal the eager
    engine's after every step; verification rounds run eagerly in both."""
    artifact = open_artifact(str(make_tiny_qwen3_5(tmp_root, mtp=True, dtype="float32")))
    model = artifact.load_model(dtype=torch.float32, device="cpu")
    runner_class = engine_core.ModelRunner

    def with_step_graphs(*args, step_graph_tokens: int = 0, **kwargs):
        return runner_class(*args, step_graph_tokens=64, **kwargs)

    config = EngineConfig(max_concurrency=3, prefill_chunk=48, mixed_prefill_chunk=24, max_context=256,
                          spec="mtp", draft_tokens=3, adaptive_drafts=False, log_stats_interval_ms=0)
    eager = EngineCore(model, artifact.tokenizer, config)
    monkeypatch.setattr(engine_core, "ModelRunner", with_step_graphs)
    graph = EngineCore(model, artifact.tokenizer, config)
    assert eager.runner.step_graphs is None and graph.runner.step_graphs.keep_hidden
    runs = _count_runs(graph.runner.step_graphs)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=12, seed=1234)
    arrivals = {
        0: [EngineRequest("greedy", list(range(1000, 1070)), GREEDY, max_new_tokens=14)],
        2: [EngineRequest("sampled", list(range(2000, 2031)), sampled, max_new_tokens=18)],
        6: [EngineRequest("late", list(range(3000, 3090)), GREEDY, max_new_tokens=9)],
    }

    def same_drafter_state(step: int) -> None:
        ours, theirs = graph.runner, eager.runner
        # Pages on dim 1 and slots on dim 0; the scratch page and slot past the pools are the padded runner's alone.
        for name, dim, mine, reference in (("keys", 1, ours.kv_cache.k, theirs.kv_cache.k),
                                           ("values", 1, ours.kv_cache.v, theirs.kv_cache.v),
                                           ("slot hidden", 0, ours.speculator.slot_hidden, theirs.speculator.slot_hidden),
                                           ("drafts' q", 0, ours.speculator.q_probs, theirs.speculator.q_probs)):
            size = min(mine.shape[dim], reference.shape[dim])
            torch.testing.assert_close(mine.narrow(dim, 0, size), reference.narrow(dim, 0, size), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"step {step}, {name}: {m}")

    outputs, finals = _lockstep(graph, eager, arrivals, same_drafter_state)
    assert {rid: len(ids) for rid, ids in outputs.items()} == {"greedy": 14, "sampled": 18, "late": 9}
    assert runs, "no step replayed the padded forward"
    assert sum(o.speculative.rounds for o in finals.values()) > 5


def _lockstep(graph: EngineCore, eager: EngineCore, arrivals: dict[int, list[EngineRequest]],
              after_step=None) -> tuple[dict[str, list[int]], dict]:
    """Step both engines together until they finish, their outputs equal at every step; -> (the
    generated ids and the last output of each request). after_step(step): more checks."""
    outputs: dict[str, list[int]] = {}
    finals = {}
    for step in range(300):
        for request in arrivals.get(step, []):
            assert graph.add_request(request) == eager.add_request(request) == []
        if step > max(arrivals) and not graph.has_work:
            assert not eager.has_work
            return outputs, finals
        got, want = graph.step(), eager.step()
        assert graph.failed is None and eager.failed is None
        assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in got] == \
               [(o.request_id, o.new_token_ids, o.finish_reason) for o in want], f"step {step}"
        for o in got:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finals[o.request_id] = o
        if after_step is not None:
            after_step(step)
    raise AssertionError("engines did not finish")
