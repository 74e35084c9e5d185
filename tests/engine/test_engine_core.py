"""EngineCore behaviour around the loop: failed steps, engine-wide failure and the throughput record."""

from __future__ import annotations

import asyncio
import logging

import pytest

from ninfer.config import EngineConfig
from ninfer.contract.output import ErrorCode, FinishReason
from ninfer.contract.request import EngineRequest
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.server.engine_client import InProcessEngineClient
from tests.engine.test_engine_generation import PROMPTS, _models
from tests.unit.conftest import make_byte_tokenizer


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _models("llama", str(tmp_path_factory.mktemp("core-models")))[1]


def greedy(request_id: str, max_new: int = 50) -> EngineRequest:
    return EngineRequest(request_id, PROMPTS[0], SamplingParams(temperature=0.0), max_new_tokens=max_new)


def run_to_end(core: EngineCore, max_steps: int = 2000) -> dict[str, list]:
    """Step until idle: request id -> its outputs."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not core.has_work:
            return outputs
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not go idle")


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def fail_launch(core: EngineCore, at_calls: set[int]) -> None:
    """Make runner.launch raise on the given calls (1-based), as a device fault would."""
    original = core.runner.launch
    calls = {"n": 0}

    def flaky(step):
        calls["n"] += 1
        if calls["n"] in at_calls:
            raise RuntimeError("simulated device fault")
        return original(step)

    core.runner.launch = flaky


def alone(llama, request: EngineRequest) -> list[int]:
    core = EngineCore(llama, make_byte_tokenizer(), EngineConfig(max_concurrency=1, max_context=256))
    core.add_request(request)
    return tokens_of(run_to_end(core)[request.request_id])


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_step_ends_only_its_requests_and_the_engine_goes_on(llama, overlap):
    config = EngineConfig(max_concurrency=2, max_context=256, kv_capacity=1024, log_stats_interval_ms=0,
                          decode_overlap=overlap)
    core = EngineCore(llama, make_byte_tokenizer(), config)
    baseline = core.pool_accounting()
    fail_launch(core, {4})  # a and b are both decoding by then
    for request in (greedy("a"), greedy("b"), greedy("c")):
        core.add_request(request)  # c waits for a lane: it is in no step when the fault hits
    outs = run_to_end(core)
    for rid in "ab":
        final = outs[rid][-1]
        assert final.finish_reason is FinishReason.ERROR and final.error.code is ErrorCode.STEP_FAILED
        assert "simulated device fault" in final.error.message
    assert core.failed is None
    assert outs["c"][-1].finish_reason is FinishReason.LENGTH
    assert tokens_of(outs["c"]) == alone(llama, greedy("c"))  # untouched by the failure
    core.add_request(greedy("d"))  # and later requests are served as before
    after = run_to_end(core)
    assert tokens_of(after["d"]) == alone(llama, greedy("d"))
    core.scheduler.cache.clear()
    assert core.pool_accounting() == baseline  # nothing leaked


def test_a_failed_prefill_leaves_the_decoding_request_alone_when_it_is_not_in_the_step(llama):
    # One lane: a decodes to the end; b's prompt step fails afterwards; c still completes.
    config = EngineConfig(max_concurrency=1, max_context=256, log_stats_interval_ms=0)
    core = EngineCore(llama, make_byte_tokenizer(), config)
    baseline = core.pool_accounting()
    core.add_request(greedy("a", max_new=5))
    core.add_request(EngineRequest("b", PROMPTS[1], SamplingParams(temperature=0.0), max_new_tokens=5))
    core.add_request(greedy("c", max_new=5))
    fail_launch(core, {6})  # a: 1 prompt step + 4 decode steps; the 6th launch is b's prompt
    outs = run_to_end(core)
    assert tokens_of(outs["a"]) == alone(llama, greedy("a", max_new=5))
    assert outs["b"][-1].error.code is ErrorCode.STEP_FAILED
    assert tokens_of(outs["c"]) == alone(llama, greedy("c", max_new=5))
    core.scheduler.cache.clear()
    assert core.pool_accounting() == baseline


def test_steps_failing_in_a_row_fail_the_engine(llama):
    config = EngineConfig(max_concurrency=2, max_context=256, log_stats_interval_ms=0)
    core = EngineCore(llama, make_byte_tokenizer(), config)
    fail_launch(core, set(range(1, 100)))
    for rid in "abcdef":
        core.add_request(greedy(rid))
    outs = run_to_end(core)
    codes = [outs[rid][-1].error.code for rid in "abcdef"]
    assert codes[:4] == [ErrorCode.STEP_FAILED] * 4  # two lanes' worth, twice: contained...
    assert core.failed is not None and "in a row" in core.failed
    assert codes[4:] == [ErrorCode.ENGINE_FAILURE] * 2  # ...the third failure in a row fails the engine
    assert core.add_request(greedy("g"))[0].error.code is ErrorCode.ENGINE_FAILURE


def test_throughput_record_reports_interval_counters(llama, caplog):
    clock = {"now": 0.0}
    config = EngineConfig(max_concurrency=2, max_context=256, log_stats_interval_ms=1000)
    core = EngineCore(llama, make_byte_tokenizer(), config, clock=lambda: clock["now"])
    core.add_request(greedy("a", max_new=6))
    core.add_request(greedy("b", max_new=6))
    with caplog.at_level(logging.INFO, logger="ninfer.engine"):
        while core.has_work:
            core.step()
            clock["now"] += 0.3
    records = [r.getMessage() for r in caplog.records if r.getMessage().startswith("throughput")]
    assert records, "no throughput record"
    assert any("prefill" in r and "tok/s" in r for r in records)
    assert any("decode" in r and "batch" in r for r in records)
    assert all("\x1b[" not in r for r in records)


def test_debug_records_show_every_planning_decision(llama, caplog):
    config = EngineConfig(max_concurrency=1, max_context=256, log_stats_interval_ms=0)
    core = EngineCore(llama, make_byte_tokenizer(), config)
    with caplog.at_level(logging.DEBUG, logger="ninfer.engine"):
        core.add_request(greedy("a", max_new=3))
        run_to_end(core)
        again = EngineRequest("b", PROMPTS[0], SamplingParams(temperature=0.0), max_new_tokens=3)
        core.add_request(again)
        run_to_end(core)
    records = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(r.startswith("admit a: prompt") and "from root" in r for r in records), records
    assert any(r.startswith("admit b: prompt") and "from checkpoint" in r for r in records), records
    assert any("captures checkpoint" in r for r in records), records


def serve_one_request(llama, config: EngineConfig, attach, done) -> None:
    """Run one 4-token request through an in-process engine loop; attach(client) subscribes to
    what the engine publishes, done() says when what the test waits for has arrived (2 s at most)."""
    client = InProcessEngineClient(config, lambda: EngineCore(llama, make_byte_tokenizer(), config))
    attach(client)

    async def scenario():
        await client.start()
        try:
            outs = [o async for o in client.generate(greedy("a", max_new=4))]
            assert outs[-1].finished
            for _ in range(100):  # nothing else arrives: the loop must wake and publish by itself
                if done():
                    break
                await asyncio.sleep(0.02)
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_the_last_busy_interval_is_reported_at_its_boundary_even_when_the_engine_goes_idle(llama):
    config = EngineConfig(max_concurrency=1, max_context=256, log_stats_interval_ms=300)
    records: list[dict] = []
    serve_one_request(llama, config, lambda client: setattr(client, "on_stats", records.append), lambda: records)
    assert records, "the interval that computed the request was never reported"
    assert sum(r["decode_tokens"] for r in records) == 3 and sum(r["prefill_tokens"] for r in records) > 0


def test_the_engine_publishes_pool_gauges_once_each_time_it_turns_idle(llama):
    config = EngineConfig(max_concurrency=1, max_context=256, log_stats_interval_ms=0)
    core = EngineCore(llama, make_byte_tokenizer(), config)
    assert core.take_idle_gauges() is None  # nothing ran yet
    core.add_request(greedy("a", max_new=3))
    core.step()
    assert core.take_idle_gauges() is None  # still working
    run_to_end(core)
    gauges = core.take_idle_gauges()
    assert gauges is not None and core.take_idle_gauges() is None
    # The finished request's turn-closure checkpoint still holds its pages and a slot.
    assert gauges["checkpoints"] == len(core.cache) >= 1
    assert gauges["kv_pages_used"] == core.kv_pool.num_used > 0
    assert gauges["state_slots_used"] == core.state_pool.num_slots - core.state_pool.num_free


def test_idle_gauges_reach_the_client_without_throughput_records(llama):
    config = EngineConfig(max_concurrency=1, max_context=256, log_stats_interval_ms=0)
    seen: list[dict] = []
    serve_one_request(llama, config, lambda client: setattr(client, "on_gauges", seen.append),
                      lambda: seen and seen[-1]["checkpoints"])
    assert seen and seen[-1]["checkpoints"] >= 1 and seen[-1]["kv_pages_used"] > 0
