"""Step graphs captured while the engine is idle (a served engine is ready before they are): a step
replays only its own bucket's graph once captured and runs eagerly before; the loop captures one
graph per idle turn, never while a step runs, and a waiting request goes first. On the CPU the
capture is a stand-in whose replay runs the region uncaptured (tests/gpu/test_step_graphs.py
captures on CUDA)."""

from __future__ import annotations

import pytest
import torch

from ninfer.config import EngineConfig
from ninfer.contract.messages import AddRequest, Outputs, Shutdown
from ninfer.contract.request import EngineRequest
from ninfer.contract.sampling import SamplingParams
from ninfer.engine import core as engine_core
from ninfer.engine import step_graphs as step_graphs_module
from ninfer.engine.core import EngineCore
from ninfer.engine.loop import EngineLoop
from ninfer.engine.scheduler import SchedulerStep, StepKind
from tests.engine.test_step_graphs import _assert_same_caches, _count_runs, _runners, chunk, tokens
from tests.gpu.test_cuda_graphs import _model
from tests.unit.conftest import make_byte_tokenizer

GREEDY = SamplingParams(temperature=0.0, seed=0)


class _ReplayedRegion:
    """A captured graph's stand-in: replay runs the captured region again."""

    def __init__(self, region):
        self.region = region

    def replay(self):
        self.region()


@pytest.fixture
def stand_in_capture(monkeypatch):
    captured = []

    def capture(region, pool, device, phases=None):
        output = region()  # the warm-up run
        captured.append(region)
        return _ReplayedRegion(region), output

    monkeypatch.setattr(step_graphs_module, "capture_graph", capture)
    return captured


def _as_if_on_cuda(graphs) -> None:
    graphs.captures = True  # a step replays only what capture_next captured
    graphs._pool = None


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("idle-capture-models"))


def test_a_step_replays_only_its_own_captured_bucket(tmp_root, stand_in_capture):
    model = _model("qwen3_5", tmp_root, torch.float32, "cpu")
    padded, eager = _runners(model, step_graph_tokens=64, max_batch=2)
    graphs = padded.step_graphs
    _as_if_on_cuda(graphs)
    runs = _count_runs(graphs)
    assert graphs.buckets == [16, 32, 64] and len(graphs.pending) == 2 * len(graphs.buckets)
    small, medium = [chunk(0, tokens(1, 10), 0)], [chunk(1, tokens(2, 30), 0)]
    assert not graphs.can_run(small) and not graphs.can_run(medium)  # nothing captured yet

    # Capture largest first, down to the 32-token bucket without checkpoints.
    while graphs.pending[0] != (32, True):
        graphs.capture_next()
    assert (32, False) in graphs.graphs and (16, False) not in graphs.graphs
    assert graphs.can_run(medium) and not graphs.can_run(small)  # 10 tokens: bucket 16, not captured
    for step in (small, medium):
        ids = [runner.execute(SchedulerStep(StepKind.PREFILL, step)) for runner in (padded, eager)]
        assert ids[0] == ids[1]
    assert runs == [30]  # the 10-token step ran eagerly, not padded into a larger bucket
    _assert_same_caches(padded, eager, [0, 1], "partly captured")

    while graphs.pending:
        graphs.capture_next()
    assert graphs.can_run([chunk(2, tokens(3, 5), 0)])
    assert len(stand_in_capture) == 2 * len(graphs.buckets)


def test_the_loop_captures_in_idle_turns_and_serves_a_request_first(tmp_root, stand_in_capture, monkeypatch):
    model = _model("qwen3_5", tmp_root, torch.float32, "cpu")
    tokenizer = make_byte_tokenizer()
    config = EngineConfig(max_concurrency=2, prefill_chunk=48, mixed_prefill_chunk=24, max_context=192,
                          decode_overlap=True, log_stats_interval_ms=0)
    eager = EngineCore(model, tokenizer, config)
    runner_class = engine_core.ModelRunner

    def with_step_graphs(*args, step_graph_tokens: int = 0, **kwargs):
        return runner_class(*args, step_graph_tokens=80, **kwargs)

    monkeypatch.setattr(engine_core, "ModelRunner", with_step_graphs)
    core = EngineCore(model, tokenizer, config, step_graphs_while_idle=True)
    graphs = core.runner.step_graphs
    _as_if_on_cuda(graphs)
    num_graphs = len(graphs.pending)
    assert core.has_background_work and not graphs.graphs

    request = EngineRequest("first", [ord(c) for c in "The quick brown fox jumps. " * 3], GREEDY, max_new_tokens=6)
    events: list[str] = []
    background_step = core.background_step

    def counted_background_step():
        assert not core.has_work, "a graph was captured while a step was in flight"
        events.append("capture")
        background_step()

    core.background_step = counted_background_step
    # The builder keeps its kernel record after each capture and ends it after the last.
    core.after_background_steps(lambda done: events.append("done" if done else "kept"))
    script = iter([None, None, AddRequest(request)])  # two idle turns, then the request arrives

    def receive(timeout):
        if timeout is not None and timeout > 0 or timeout is None:
            return Shutdown()  # blocking: the loop has nothing left to do
        message = next(script, None)
        events.append("request" if isinstance(message, AddRequest) else "poll")
        return message

    published = []
    EngineLoop(core, receive, published.append, idle_grace_s=0.0).run()  # the grace: test_engine_loop.py

    got = [token for message in published if isinstance(message, Outputs) for o in message.outputs
           for token in o.new_token_ids]
    assert eager.add_request(request) == []
    want = []
    while eager.has_work:
        want += [token for o in eager.step() for token in o.new_token_ids]
    assert got == want and len(got) == 6
    # Captures run only in idle turns: two before the request, none while it ran, the rest after.
    first_request = events.index("request")
    assert events[:first_request].count("capture") == 2
    assert events.count("capture") == num_graphs and not graphs.pending and len(graphs.graphs) == num_graphs
    assert not core.has_background_work
    # After every capture: kept after each but the last, done once right after the last.
    after_captures = [events[i + 1] for i, event in enumerate(events) if event == "capture"]
    assert after_captures == ["kept"] * (num_graphs - 1) + ["done"] and events[-1] == "done"
