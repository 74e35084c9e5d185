"""A checkpoint captured inside a step (the chunk goes on past its frontier) holds what a step
that ended at the frontier leaves behind, and the prompt's tail costs no step of its own."""

from __future__ import annotations

import pytest
import torch

from ninfer.config import EngineConfig
from ninfer.contract.request import CaptureHint, EngineRequest
from ninfer.contract.reuse_path import ReusePath
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.engine.scheduler import StepKind
from ninfer.engine.scheduler.chunks import PromptChunks
from tests.engine.test_engine_core import run_to_end, tokens_of
from tests.engine.test_engine_generation import _models, hf_greedy
from tests.unit.conftest import make_byte_tokenizer

HISTORY = [ord(c) for c in "An agent's conversation so far, with a tool result in it. " * 2]
FRONTIER = len(HISTORY) - 5  # the turn closure; its last 5 tokens stand in for the generation prompt
NEXT_TURN = HISTORY[:FRONTIER] + [ord(c) for c in " and the next turn's new message."]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next", "llama"])
def models(request, tmp_path_factory):
    return _models(request.param, str(tmp_path_factory.mktemp("snapshot-models")))


def _recording_engine(model) -> tuple[EngineCore, dict, list]:
    """One lane; -> (the engine, its pool accounting before any request, the steps it launches)."""
    config = EngineConfig(max_concurrency=1, max_context=256, kv_capacity=512, log_stats_interval_ms=0)
    core = EngineCore(model, make_byte_tokenizer(), config)
    baseline = core.pool_accounting()
    steps = []
    launch = core.runner.launch
    core.runner.launch = lambda step: steps.append(step) or launch(step)
    return core, baseline, steps


def _run(model, monkeypatch, in_step: bool):
    """Both turns on a fresh engine; -> (prompt steps of the first turn, the checkpoint's state
    and logits, both turns' outputs)."""
    original = PromptChunks._snapshots_in_step
    monkeypatch.setattr(PromptChunks, "_snapshots_in_step", lambda self, seq: in_step and original(self, seq))
    core, baseline, steps = _recording_engine(model)
    greedy = SamplingParams(temperature=0.0)
    hint = [CaptureHint(FRONTIER, ReusePath.PRIVATE_TURN_CLOSURE)]
    core.add_request(EngineRequest("t1", HISTORY, greedy, max_new_tokens=6, capture_hints=hint))
    first = run_to_end(core)["t1"]
    prompt_steps = [[(c.num_computed_tokens, len(c.token_ids), c.snapshot_tokens) for c in s.chunks]
                    for s in steps if s.kind is StepKind.PREFILL]
    (checkpoint,) = [ck for ck in core.scheduler.cache.checkpoints.values() if ck.frontier == FRONTIER]
    runner = core.runner
    slot = checkpoint.state_slot
    state = [runner.slot_logits[slot].clone()]
    if runner.state_cache is not None:
        state += [runner.state_cache.conv[:, slot].clone(), runner.state_cache.recurrent[:, slot].clone()]
    core.add_request(EngineRequest("t2", NEXT_TURN, greedy, max_new_tokens=6))
    second = run_to_end(core)["t2"]
    if runner.state_cache is not None:  # hybrid models resume exactly there; attention-only ones may go on
        assert second[-1].cached_tokens == FRONTIER and second[-1].reuse_path == ReusePath.PRIVATE_TURN_CLOSURE.value
    else:
        assert second[-1].cached_tokens >= FRONTIER
    core.scheduler.cache.clear()
    assert core.pool_accounting() == baseline
    return prompt_steps, state, tokens_of(first), tokens_of(second)


def test_a_checkpoint_inside_a_step_equals_one_after_a_step_that_ends_there(models, monkeypatch):
    hf, ours = models
    steps_in, state_in, first_in, second_in = _run(ours, monkeypatch, in_step=True)
    steps_split, state_split, first_split, second_split = _run(ours, monkeypatch, in_step=False)
    assert steps_in == [[(0, len(HISTORY), FRONTIER)]]  # one prompt step, the tail included
    assert steps_split == [[(0, FRONTIER, 0)], [(FRONTIER, 5, 0)]]
    for inside, after in zip(state_in, state_split, strict=True):
        torch.testing.assert_close(inside, after, rtol=1e-5, atol=1e-5)
    assert first_in == first_split == hf_greedy(hf, HISTORY, 6)
    assert second_in == second_split == hf_greedy(hf, NEXT_TURN, 6)


def test_a_prompt_chunk_takes_one_snapshot_and_ends_at_the_next_frontier(models, monkeypatch):
    hf, ours = models
    core, baseline, steps = _recording_engine(ours)
    hints = [CaptureHint(40, ReusePath.SHARED_STABLE_PREFIX), CaptureHint(FRONTIER, ReusePath.PRIVATE_TURN_CLOSURE)]
    greedy = SamplingParams(temperature=0.0)
    core.add_request(EngineRequest("a", HISTORY, greedy, max_new_tokens=4, capture_hints=hints))
    outputs = tokens_of(run_to_end(core)["a"])
    chunks = [(c.num_computed_tokens, len(c.token_ids), c.snapshot_tokens) for s in steps
              if s.kind is StepKind.PREFILL for c in s.chunks]
    assert chunks == [(0, FRONTIER, 40), (FRONTIER, 5, 0)]  # the second frontier ends the chunk
    assert {40, FRONTIER} <= {ck.frontier for ck in core.scheduler.cache.checkpoints.values()}
    assert outputs == hf_greedy(hf, HISTORY, 4)
    core.scheduler.cache.clear()
    assert core.pool_accounting() == baseline
