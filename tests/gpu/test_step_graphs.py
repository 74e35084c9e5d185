"""Step graphs on the GPU: a prompt or mixed step replayed from its bucket's CUDA graph computes what
the eager step computes (logits, KV, states within bf16 rounding: the matrix products run at the
bucket's row count), with and without a checkpoint inside the step, and an engine with step
graphs, captured at once or in idle turns, generates the eager engine's greedy tokens (fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ninfer.artifact import open_artifact
from ninfer.config import EngineConfig
from ninfer.contract.request import CaptureHint, EngineRequest
from ninfer.contract.reuse_path import ReusePath
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.engine.runner import ModelRunner
from ninfer.engine.scheduler import ResetSlot, SchedulerStep, StepKind, chunks
from tests.engine.test_step_graphs import NUM_SLOTS, PAGE_SIZE, PAGES_PER_REQUEST, _count_runs, chunk, tokens
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.gpu.test_cuda_graphs import ARCHITECTURES, _model, needs_cuda
from tests.unit.conftest import make_byte_tokenizer

pytestmark = [pytest.mark.gpu, needs_cuda]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("step-graph-gpu-models"))


def _runners(model) -> tuple[ModelRunner, ModelRunner]:
    make = lambda step_graph_tokens: ModelRunner(  # noqa: E731
        model, NUM_SLOTS * PAGES_PER_REQUEST, PAGE_SIZE, num_state_slots=NUM_SLOTS, max_batch=4,
        cuda_graph_batch_sizes=range(1, 5), step_graph_tokens=step_graph_tokens,
    )
    graphed, eager = make(200), make(0)
    assert graphed.step_graphs is not None and graphed.step_graphs.graphs, "step graphs were not captured"
    for runner in (graphed, eager):
        runner.execute(SchedulerStep(StepKind.PREFILL, [], before=[ResetSlot(s) for s in range(NUM_SLOTS)]))
    return graphed, eager


def _assert_close(graphed: ModelRunner, eager: ModelRunner, slots: list[int], what: str) -> None:
    pages = torch.tensor([p for s in slots for p in chunk(s, [], 0).page_ids], device="cuda")
    pairs = [("logits", graphed.slot_logits[slots], eager.slot_logits[slots]),
             ("keys", graphed.kv_cache.k[:, pages], eager.kv_cache.k[:, pages])]
    if eager.state_cache is not None:
        for name in ("conv", "recurrent"):
            got, want = getattr(graphed.state_cache, name), getattr(eager.state_cache, name)
            pairs.append((name, got[:, slots], want[:, slots]))
    for name, got, want in pairs:
        diff = (got.float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        assert diff <= 0.02 * scale, f"{what}, {name}: max |diff| {diff} (scale {scale:.3g})"


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_replayed_prompt_and_mixed_steps_equal_eager_steps(arch, tmp_root):
    model = _model(arch, tmp_root, torch.bfloat16, "cuda")
    graphed, eager = _runners(model)
    replays = []
    for key, graph in list(graphed.step_graphs.graphs.items()):
        graphed.step_graphs.graphs[key] = _Counted(graph, key, replays)
    histories = {i: tokens(i, 12 + 33 * i) for i in range(4)}  # 12..111 tokens: buckets 16..132
    for i, prompt in histories.items():
        ids = [runner.execute(SchedulerStep(StepKind.PREFILL, [chunk(i, prompt, 0)])) for runner in (graphed, eager)]
        assert ids[0] == ids[1], f"prompt {i}"
    _assert_close(graphed, eager, list(histories), "prompts")
    mixed = [chunk(0, [7], len(histories[0])), chunk(1, [8], len(histories[1])), chunk(4, tokens(40, 70), 0),
             chunk(3, tokens(41, 37), len(histories[3])), chunk(5, tokens(42, 1), 0)]
    ids = [runner.execute(SchedulerStep(StepKind.MIXED, mixed)) for runner in (graphed, eager)]
    assert ids[0] == ids[1]
    _assert_close(graphed, eager, [0, 1, 3, 4, 5], "mixed step")
    snapshotting = chunk(2, tokens(50, 140), len(histories[2]), snapshot_tokens=133, snapshot_slot=6)
    step = [chunk(1, [9], len(histories[1]) + 1), snapshotting]
    ids = [runner.execute(SchedulerStep(StepKind.MIXED, step)) for runner in (graphed, eager)]
    assert ids[0] == ids[1]
    _assert_close(graphed, eager, [1, 2, 6], "checkpoint inside the step")
    # Buckets up to 200 tokens: powers of two from 16 (the GEMV's last row count), then 200; the
    # MoE model's also end where its expert kernels change (4 to 128 tokens at top-2 of 8 experts).
    buckets = graphed.step_graphs.buckets
    if not model.config.is_moe:
        assert buckets == [16, 32, 64, 128, 200]
    step_tokens = [12, 45, 78, 111, 110, 141]
    assert [key for key, _ in replays] == [(next(b for b in buckets if b >= t), t == 141) for t in step_tokens]


class _Counted:
    def __init__(self, graph, key, replays: list):
        self.graph, self.key, self.replays = graph, key, replays

    def replay(self) -> None:
        self.replays.append((self.key, None))
        self.graph.replay()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_an_engine_with_step_graphs_generates_the_eager_engines_greedy_tokens(arch, tmp_root, monkeypatch):
    """In fp32: a replayed step runs its products at the bucket's row count, which in bf16 rounds
    differently (the test above bounds that), and a random model's greedy tokens sit on near ties
    often enough to flip (measured on an H100: the llama model's checkpointed request only, in
    bf16; identical in fp32). The turn closure is snapshotted inside its step even beside decode
    rows (the scheduler leaves that to frontiers with many tokens after them; these prompts are short)."""
    monkeypatch.setattr(chunks, "MIN_TOKENS_AFTER_SNAPSHOT_BESIDE_DECODE", 0)
    model = _model(arch, tmp_root, torch.float32, "cuda")
    tokenizer = make_byte_tokenizer()
    config = EngineConfig(max_concurrency=3, prefill_chunk=96, mixed_prefill_chunk=48, max_context=256,
                          log_stats_interval_ms=0)
    graphed = EngineCore(model, tokenizer, config)
    eager = EngineCore(model, tokenizer, dataclasses.replace(config, cuda_graphs=False))
    assert graphed.runner.step_graphs is not None and eager.runner.step_graphs is None
    text = lambda s: [ord(c) for c in s]  # noqa: E731
    prompt = text("A conversation with a turn closure inside it. " * 3)
    requests = [
        EngineRequest("greedy", text("The quick brown fox jumps over the lazy dog. " * 4), GREEDY, max_new_tokens=24),
        EngineRequest("short", text("Hi"), GREEDY, max_new_tokens=16),
        EngineRequest("turn", prompt, GREEDY, max_new_tokens=16,
                      capture_hints=[CaptureHint(len(prompt) - 5, ReusePath.PRIVATE_TURN_CLOSURE)]),
    ]
    assert _generate(graphed, requests) == _generate(eager, requests)


def test_a_speculative_engine_with_step_graphs_generates_the_eager_engines_tokens(tmp_root):
    """Under --spec mtp the prompt steps replay step graphs and the MTP head's pass follows from the
    replay's hidden states: greedy tokens and every request's acceptance equal the eager engine's
    (fp32, as above; the CPU test compares the head's KV and drafts after every step)."""
    artifact = open_artifact(str(make_tiny_qwen3_5(tmp_root, mtp=True, dtype="float32")))
    model = artifact.load_model(dtype=torch.float32, device="cuda")
    config = EngineConfig(max_concurrency=3, prefill_chunk=96, mixed_prefill_chunk=48, max_context=256,
                          spec="mtp", draft_tokens=3, adaptive_drafts=False, log_stats_interval_ms=0)
    graphed = EngineCore(model, artifact.tokenizer, config)
    eager = EngineCore(model, artifact.tokenizer, dataclasses.replace(config, cuda_graphs=False))
    assert graphed.runner.step_graphs is not None and eager.runner.step_graphs is None
    runs = _count_runs(graphed.runner.step_graphs)
    requests = [
        EngineRequest("long", list(range(1000, 1150)), GREEDY, max_new_tokens=24),
        EngineRequest("short", list(range(2000, 2012)), GREEDY, max_new_tokens=16),
        EngineRequest("mid", list(range(3000, 3070)), GREEDY, max_new_tokens=20),
    ]
    finals: dict[str, dict] = {}
    assert _generate(graphed, requests, finals.setdefault("graphed", {})) == \
        _generate(eager, requests, finals.setdefault("eager", {}))
    assert runs
    assert {rid: o.speculative for rid, o in finals["graphed"].items()} == \
        {rid: o.speculative for rid, o in finals["eager"].items()}


def _generate(core: EngineCore, requests: list[EngineRequest], finals: dict | None = None) -> dict[str, list[int]]:
    """Every request run to its end on `core` -> its generated ids, by request id (finals: each
    request's last output, filled in)."""
    for request in requests:
        assert core.add_request(request) == []
    outputs: dict[str, list[int]] = {}
    while core.has_work:
        for o in core.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if finals is not None and o.finish_reason is not None:
                finals[o.request_id] = o
        assert core.failed is None
    return outputs


def test_graphs_captured_in_idle_turns_generate_the_eager_engines_greedy_tokens(tmp_root):
    """A served engine's step graphs: none at first (prompt steps run eagerly), then captured one
    per idle turn between requests, each replayed once captured; greedy tokens equal the eager
    engine's throughout (fp32, as above)."""
    model = _model("qwen3_5", tmp_root, torch.float32, "cuda")
    tokenizer = make_byte_tokenizer()
    config = EngineConfig(max_concurrency=3, prefill_chunk=96, mixed_prefill_chunk=48, max_context=256,
                          log_stats_interval_ms=0)
    idle = EngineCore(model, tokenizer, config, step_graphs_while_idle=True)
    eager = EngineCore(model, tokenizer, dataclasses.replace(config, cuda_graphs=False))
    graphs = idle.runner.step_graphs
    assert graphs is not None and not graphs.graphs and idle.has_background_work
    text = lambda s: [ord(c) for c in s]  # noqa: E731

    def generate(core, round_index: int) -> dict[str, list[int]]:
        return _generate(core, [
            EngineRequest(f"{round_index}-long", text(f"Round {round_index}: the quick brown fox. " * 4), GREEDY,
                          max_new_tokens=12),
            EngineRequest(f"{round_index}-short", text(f"Hi {round_index}"), GREEDY, max_new_tokens=8),
        ])

    for round_index in range(4):
        assert generate(idle, round_index) == generate(eager, round_index), f"round {round_index}"
        for _ in range(len(graphs.buckets) // 2 + 1):  # about half the graphs per idle spell
            if idle.has_background_work:
                idle.background_step()
    assert not graphs.pending and len(graphs.graphs) == 2 * len(graphs.buckets)
    assert generate(idle, 4) == generate(eager, 4)
