"""EngineCore behaviour around the loop: engine-wide failure and the throughput record."""

from __future__ import annotations

import asyncio
import logging

import pytest

from ninfer.config import EngineConfig
from ninfer.contract.output import ErrorCode, FinishReason
from ninfer.contract.request import EngineRequest
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.server.engine_client import EngineUnavailable, InProcessEngineClient
from tests.engine.test_engine_generation import PROMPTS, _models
from tests.unit.conftest import make_byte_tokenizer


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _models("llama", str(tmp_path_factory.mktemp("core-models")))[1]


def greedy(request_id: str, max_new: int = 50) -> EngineRequest:
    return EngineRequest(request_id, PROMPTS[0], SamplingParams(temperature=0.0), max_new_tokens=max_new)


def test_engine_failure_ends_every_request_and_marks_unhealthy(llama):
    config = EngineConfig(max_concurrency=2, max_context=256, log_stats_interval_ms=0)
    core = EngineCore(llama, make_byte_tokenizer(), config)
    client = InProcessEngineClient(config, lambda: core)
    original = core.runner.launch
    calls = {"n": 0}

    def flaky(step):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("simulated device fault")
        return original(step)

    core.runner.launch = flaky

    async def scenario():
        await client.start()
        try:
            streams = [client.generate(greedy("a")), client.generate(greedy("b"))]

            async def drain(stream):
                return [o async for o in stream]

            results = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), 30)
            for outs in results:
                assert outs[-1].finish_reason is FinishReason.ERROR
                assert outs[-1].error.code is ErrorCode.ENGINE_FAILURE
            for _ in range(100):
                if not client.healthy:
                    break
                await asyncio.sleep(0.01)
            assert not client.healthy
            with pytest.raises(EngineUnavailable):
                async for _ in client.generate(greedy("c")):
                    pass
        finally:
            await client.shutdown()

    asyncio.run(scenario())


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
