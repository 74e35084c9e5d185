"""Warm-up runs every step shape of a configuration and leaves the engine as it found it; a start
whose full warm-up already ran runs the short one."""

from __future__ import annotations

import dataclasses

import pytest

from ninfer.config import EngineConfig
from ninfer.contract.request import EngineRequest
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.engine.scheduler import StepKind
from ninfer.engine.warm_up import TAIL_LENGTHS, run_warm_up, warm_up_plan, worst_step_requests
from ninfer.engine.warm_up_record import WarmUpRecords
from tests.engine.test_engine_core import alone, run_to_end, tokens_of
from tests.engine.test_engine_generation import PROMPTS, _models
from tests.unit.conftest import make_byte_tokenizer


# max_context 30 < the 40-token budget: two requests' prompts fill the first step.
SMALL = EngineConfig(max_concurrency=3, prefill_chunk=40, mixed_prefill_chunk=8, max_context=30, kv_capacity=256,
                     log_stats_interval_ms=0)


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def model(request, tmp_path_factory):
    return _models(request.param, str(tmp_path_factory.mktemp("warm-up-models")))[1]


def test_warm_up_covers_the_worst_step_mixed_steps_and_decode_then_restores_the_pools(model):
    core = EngineCore(model, make_byte_tokenizer(), SMALL)
    baseline = core.pool_accounting()
    steps = []
    launch = core.runner.launch
    core.runner.launch = lambda step: steps.append(step) or launch(step)
    report = run_warm_up(core)
    assert steps[0].kind is StepKind.PREFILL and steps[0].num_tokens == 40 == report.worst_step_tokens
    assert len(steps[0].chunks) == 2
    mixed = [s for s in steps if s.kind is StepKind.MIXED]
    assert mixed and max(s.num_tokens for s in mixed) == 8  # the mixed budget, decode rows included
    assert {len(s.chunks) for s in steps if s.kind is StepKind.DECODE} >= {2, 3}  # decode batches
    continuations = [c for s in steps if s.kind is StepKind.PREFILL for c in s.chunks if c.num_computed_tokens > 0]
    assert continuations, "a prompt chunk over cached context in a prompt-only step"
    assert any(c.snapshot_slot is not None for c in continuations), "a checkpoint inside a step"
    # A chat's generation prompt after its turn-closure checkpoint: a few query rows alone in a step.
    tails = {len(s.chunks[0].token_ids) for s in steps
             if s.kind is StepKind.PREFILL and len(s.chunks) == 1 and s.chunks[0].num_computed_tokens > 0}
    assert set(TAIL_LENGTHS) <= tails, tails
    rows = [c for s in steps for c in s.chunks if c.sample]
    assert any(c.sampling.temperature > 0 and c.sampling.presence_penalty == 0 for c in rows)  # sampled
    assert any(c.sampling.presence_penalty > 0 and len(c.token_ids) == 1 for c in rows)  # penalized decode
    assert core.pool_accounting() == baseline and len(core.scheduler.cache) == 0
    # Nor does the cache planner's forecast remember the synthetic conversations: their pace
    # (a turn every admission) would set what real conversations are assumed to take.
    forecast = core.scheduler.cache.forecast
    assert forecast.tick == 0 and len(forecast) == 0 and forecast.typical_interval() == 1.0
    assert core.scheduler.stats.prefill_tokens == 0  # the throughput record starts after it
    core.runner.launch = launch
    short = EngineRequest("a", PROMPTS[2], SamplingParams(temperature=0.0), max_new_tokens=8)
    assert core.add_request(short) == []  # and the engine serves as if nothing ran before
    assert tokens_of(run_to_end(core)["a"]) == alone(model, short)


@pytest.mark.parametrize(
    ("prefill_chunk", "max_context", "kv_capacity", "max_concurrency", "lengths", "spec"),
    [
        (8192, 8192, 8192, 1, [8190], None),  # the default shape: one request, limited by its context
        (100, 1000, 1000, 4, [100], None),  # the budget alone
        (100, 40, 1000, 4, [38, 38, 24], None),  # several requests within their context
        (100, 40, 1000, 2, [38, 38], None),  # ... and the lanes
        (100, 1000, 64, 4, [62], None),  # the KV pool: prompt + 2 outputs in 4 pages of 16
        (8192, 8192, None, 1, [8190], {"spec": "mtp", "draft_tokens": 3}),  # the default pool holds the draft window
        (100, 1000, 64, 4, [58], {"spec": "mtp", "draft_tokens": 3}),  # ... a fixed one leaves room for it
    ],
)
def test_worst_step_requests_respect_every_limit(prefill_chunk, max_context, kv_capacity, max_concurrency, lengths,
                                                 spec):
    config = EngineConfig(max_concurrency=max_concurrency, prefill_chunk=prefill_chunk, max_context=max_context,
                          kv_capacity=kv_capacity, **(spec or {}))
    requests = worst_step_requests(config, vocab_size=257)
    assert [len(r.prompt_token_ids) for r in requests] == lengths
    assert len({tuple(r.prompt_token_ids[:4]) for r in requests}) == len(requests)  # nothing shared


def test_the_short_warm_up_runs_the_worst_mixed_and_constrained_phases_only(model):
    core = EngineCore(model, make_byte_tokenizer(), SMALL)
    baseline = core.pool_accounting()
    names = []
    add = core.add_request
    core.add_request = lambda request: names.append(request.request_id) or add(request)
    report = run_warm_up(core, full=False)
    assert report.worst_step_tokens == 40
    assert all(name.startswith(("warm-worst", "warm-decode", "warm-joining", "warm-constrained")) for name in names)
    assert {"warm-worst-0", "warm-joining", "warm-constrained"} <= set(names)
    names.clear()
    full = run_warm_up(core)
    assert any(name.startswith("warm-prompt") for name in names) and any(name.startswith("warm-tail") for name in names)
    assert full.num_steps > report.num_steps
    assert core.pool_accounting() == baseline


def test_the_plan_names_what_chooses_the_warm_ups_steps():
    config = EngineConfig(max_concurrency=4, prefill_chunk=512, max_context=4096, kv_capacity=100_000)
    plan = warm_up_plan(config, vocab_size=257)
    # The pool's size counts only through the step shapes it limits; logging not at all.
    assert warm_up_plan(dataclasses.replace(config, kv_capacity=200_000, log_stats_interval_ms=7), 257) == plan
    assert warm_up_plan(dataclasses.replace(config, kv_capacity=300), 257) != plan  # the worst step shrinks
    for change in ({"prefill_chunk": 1024}, {"max_concurrency": 5}, {"kv_dtype": "fp8"}, {"prefix_reuse": False}):
        assert warm_up_plan(dataclasses.replace(config, **change), 257) != plan, change


def test_a_full_warm_up_is_recorded_and_the_next_start_runs_the_short_one(model, tmp_path, monkeypatch):
    from ninfer.engine import builder

    monkeypatch.setattr(builder, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(builder, "_probe_inputs", lambda model, draft_model, device: ("device", "libraries"))
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "a-compiled-kernel").write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(kernels))
    config = EngineConfig(max_concurrency=2, prefill_chunk=40, mixed_prefill_chunk=8, max_context=30,
                          kv_capacity=256, log_stats_interval_ms=0)
    fulls = []
    monkeypatch.setattr(builder, "run_warm_up", lambda core, full: fulls.append(full) or run_warm_up(core, full))

    def start(config):
        return builder._run_warm_up_once(EngineCore(model, make_byte_tokenizer(), config), None)

    start(config)
    start(config)
    start(dataclasses.replace(config, max_concurrency=3))  # another plan: a full one again
    assert fulls == [True, False, True]
    (kernels / "a-compiled-kernel").unlink()  # the kernel cache emptied since
    start(config)
    assert fulls[-1] is True
    (kernels / "a-compiled-kernel").write_text("")
    start(config)
    assert fulls[-1] is False
    monkeypatch.setattr(builder, "_probe_inputs", lambda model, draft_model, device: ("device", "newer libraries"))
    start(config)
    assert fulls[-1] is True


def test_records_are_kept_by_key_and_an_unwritable_folder_only_warns(tmp_path, caplog):
    records = WarmUpRecords(tmp_path / "warm-up")
    assert not records.has("a" * 64)
    records.store("a" * 64)
    assert records.has("a" * 64) and not records.has("a" * 32 + "b" * 32)
    (tmp_path / "file").write_text("")
    WarmUpRecords(tmp_path / "file" / "warm-up").store("c" * 64)
    assert "warm-up record not kept" in caplog.text
