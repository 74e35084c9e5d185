"""An engine-wide failure restarts the engine: open streams end with engine_failure, /health is 503
with the reason meanwhile, new requests are refused with Retry-After, and then the server serves
again, at most MAX_RESTARTS times in RESTART_WINDOW_S. Our own shutdown never restarts it and
does not wait for a restart under way."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from ninfer.config import EngineConfig
from ninfer.contract.output import EngineError, EngineOutput, ErrorCode, FinishReason
from ninfer.engine.core import EngineCore
from ninfer.server.engine_client import MAX_RESTARTS, EngineUnavailable, InProcessEngineClient
from ninfer.server.served_model import ServedModel
from ninfer.testing.processes import engine_process_of
from tests.engine.test_engine_generation import PROMPTS, _models
from tests.engine.test_engine_generation import greedy as greedy_request
from tests.net import start_ninfer_serve
from tests.scripted_model import ScriptedLM
from tests.server.conftest import serve_config, start_server, wait_until
from tests.server.test_process_lifecycle import wait_gone
from tests.unit.conftest import make_byte_tokenizer

CONFIG = EngineConfig(max_concurrency=2, max_context=256, log_stats_interval_ms=0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _models("llama", str(tmp_path_factory.mktemp("restart-models")))[1]


def greedy(request_id: str, max_new: int = 50):
    return greedy_request(request_id, PROMPTS[0], max_new)


def fail_engine_wide(core: EngineCore, at_step: int, ending: tuple[str, ...] = ()) -> None:
    """From step `at_step` on the core has failed engine-wide, as after a lost device: that step
    ends the `ending` requests with engine_failure itself (the core does so for the requests it
    holds); the client must end the others."""
    step = core.step
    steps = itertools.count(1)

    def failing_step() -> list[EngineOutput]:
        if core.failed is not None:
            return []
        if next(steps) < at_step:
            return step()
        core.failed = "simulated device loss"
        error = EngineError(ErrorCode.ENGINE_FAILURE, "the engine failed; see the server log")
        return [EngineOutput(rid, finish_reason=FinishReason.ERROR, error=error) for rid in ending]

    core.step = failing_step


def fresh_greedy(llama, request) -> list[int]:
    """The request's tokens on a core that never failed."""
    core = EngineCore(llama, make_byte_tokenizer(), CONFIG)
    core.add_request(request)
    tokens = []
    while core.has_work:
        tokens += [t for out in core.step() for t in out.new_token_ids]
    return tokens


async def drain(stream) -> list[EngineOutput]:
    async def collect() -> list[EngineOutput]:
        return [out async for out in stream]

    return await asyncio.wait_for(collect(), 30)


async def eventually(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_an_engine_wide_failure_ends_open_streams_then_the_engine_restarts_and_serves(llama, caplog):
    expected = fresh_greedy(llama, greedy("d", 12))
    builds = []
    may_rebuild = threading.Event()  # holds the restart, so the client can be seen restarting

    def build() -> EngineCore:
        if builds:
            may_rebuild.wait(30)
        core = EngineCore(llama, make_byte_tokenizer(), CONFIG)
        if not builds:
            fail_engine_wide(core, at_step=3, ending=("a",))
        builds.append(core)
        return core

    client = InProcessEngineClient(CONFIG, build)

    async def scenario() -> None:
        await client.start()
        try:
            results = await asyncio.gather(drain(client.generate(greedy("a"))), drain(client.generate(greedy("b"))))
            for outs in results:  # a ended by the engine, b by the client: both say the same
                assert outs[-1].finish_reason is FinishReason.ERROR
                assert outs[-1].error.code is ErrorCode.ENGINE_FAILURE
                assert outs[-1].error.message == "the engine failed and is restarting; retry the request"
            assert not client.healthy and client.restarting
            assert client.failure == "engine failed: simulated device loss; restarting (attempt 1 of 3)"
            with pytest.raises(EngineUnavailable) as refused:
                await anext(client.generate(greedy("c")))
            assert refused.value.retry_after_s >= 1
            may_rebuild.set()
            await eventually(lambda: client.healthy)
            outs = await drain(client.generate(greedy("d", 12)))
            assert outs[-1].finish_reason is FinishReason.LENGTH
            assert [t for out in outs for t in out.new_token_ids] == expected
        finally:
            may_rebuild.set()
            await client.shutdown()

    with caplog.at_level(logging.INFO, logger="ninfer.engine"):
        asyncio.run(scenario())
    assert len(builds) == 2  # the shutdown restarted nothing
    lines = [r.getMessage() for r in caplog.records]
    assert "engine failed: simulated device loss; restarting (attempt 1 of 3)" in lines
    assert any(line.startswith("engine restarted in ") and line.endswith(" s") for line in lines)


def test_the_fourth_failure_within_the_window_leaves_the_engine_failed(llama, caplog):
    builds = []

    def build() -> EngineCore:
        core = EngineCore(llama, make_byte_tokenizer(), CONFIG)
        fail_engine_wide(core, at_step=1)
        builds.append(core)
        return core

    client = InProcessEngineClient(CONFIG, build)

    async def scenario() -> None:
        await client.start()
        try:
            for failure in range(1, MAX_RESTARTS + 2):
                outs = await drain(client.generate(greedy(f"r{failure}")))
                assert outs[-1].error.code is ErrorCode.ENGINE_FAILURE
                if failure <= MAX_RESTARTS:
                    await eventually(lambda: client.healthy)
            assert outs[-1].error.message == "the engine failed and was not restarted; see the server log"
            assert not client.healthy and not client.restarting
            assert client.failure == (
                "engine failed: simulated device loss; not restarting: 3 restarts within 10 minutes; "
                "restart the server"
            )
            with pytest.raises(EngineUnavailable) as refused:
                await anext(client.generate(greedy("late")))
            assert refused.value.retry_after_s is None
        finally:
            await client.shutdown()

    with caplog.at_level(logging.ERROR, logger="ninfer.engine"):
        asyncio.run(scenario())
    assert len(builds) == 1 + MAX_RESTARTS
    assert [r.getMessage().rsplit("; ", 1)[-1] for r in caplog.records] == [
        "restarting (attempt 1 of 3)",
        "restarting (attempt 2 of 3)",
        "restarting (attempt 3 of 3)",
        "restart the server",
    ]


def test_a_restart_that_fails_counts_as_an_attempt(llama, caplog):
    builds = []

    def build() -> EngineCore:
        builds.append(None)
        if len(builds) == 2:
            raise RuntimeError("no device")
        core = EngineCore(llama, make_byte_tokenizer(), CONFIG)
        if len(builds) == 1:
            fail_engine_wide(core, at_step=1)
        return core

    client = InProcessEngineClient(CONFIG, build)

    async def scenario() -> None:
        await client.start()
        try:
            await drain(client.generate(greedy("a")))
            await eventually(lambda: client.healthy)
            outs = await drain(client.generate(greedy("b", 4)))
            assert outs[-1].finish_reason is FinishReason.LENGTH
        finally:
            await client.shutdown()

    with caplog.at_level(logging.INFO, logger="ninfer.engine"):
        asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records]
    assert "engine restart failed: no device; restarting (attempt 2 of 3)" in lines
    assert len(builds) == 3


def test_a_failing_first_start_raises_as_before_and_is_not_restarted():
    builds = []

    def build() -> EngineCore:
        builds.append(None)
        raise FileNotFoundError("no weights")

    client = InProcessEngineClient(CONFIG, build)

    async def scenario() -> None:
        with pytest.raises(FileNotFoundError, match="no weights"):
            await client.start()
        await asyncio.sleep(0.1)
        assert not client.healthy and not client.restarting
        await client.shutdown()

    asyncio.run(scenario())
    assert len(builds) == 1


def test_a_shutdown_during_a_restart_does_not_wait_for_it(llama):
    builds = []
    never = threading.Event()  # the restart's build does not finish before the test ends

    def build() -> EngineCore:
        builds.append(None)
        if len(builds) > 1:
            never.wait(60)
        core = EngineCore(llama, make_byte_tokenizer(), CONFIG)
        fail_engine_wide(core, at_step=1)
        return core

    client = InProcessEngineClient(CONFIG, build)

    async def scenario() -> None:
        await client.start()
        await drain(client.generate(greedy("a")))
        await eventually(lambda: len(builds) == 2)
        started = time.monotonic()
        await asyncio.wait_for(client.shutdown(), 5)
        assert time.monotonic() - started < 2
        assert not client.restarting

    try:
        asyncio.run(scenario())
    finally:
        never.set()
    assert len(builds) == 2


def test_health_and_refusals_over_http_while_the_engine_restarts(tiny_qwen):
    config = serve_config(tiny_qwen)
    builds = []
    may_rebuild = threading.Event()

    def build(serving: ServedModel) -> EngineCore:
        if builds:
            may_rebuild.wait(30)
        tokenizer = serving.artifact.tokenizer
        model = ScriptedLM(serving.artifact.config.vocab_size, [tokenizer.encode("fresh\n</think>\n\nback")],
                           tokenizer.token_to_id("<|im_end|>"))
        core = EngineCore(model, tokenizer, config.engine)
        if not builds:
            fail_engine_wide(core, at_step=1)
        builds.append(core)
        return core

    server = start_server(config, build)
    try:
        url = server.base_url
        body = {"model": server.serving.model_id, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 16}
        failed = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_unavailable"
        assert "restarting" in failed.json()["error"]["message"]
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503
        assert health.json() == {
            "status": "unavailable",
            "reason": "engine failed: simulated device loss; restarting (attempt 1 of 3)",
        }
        refused = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
        assert int(refused.headers["retry-after"]) >= 1
        may_rebuild.set()
        wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, what="the restart")
        assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}
        served = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert served.status_code == 200 and served.json()["choices"][0]["message"]["content"] == "back"
    finally:
        may_rebuild.set()
        server.stop()


def _chat(model: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "stream": stream}


@pytest.mark.slow
def test_a_killed_engine_process_is_restarted_and_the_server_serves_again(tiny_qwen):
    process, base = start_ninfer_serve(tiny_qwen)
    try:
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        engine = engine_process_of(process.pid)
        with ThreadPoolExecutor(1) as pool, httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=_chat(model, 4000, stream=True), timeout=60
        ) as stream:
            frames = (json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {"))
            next(frames)  # the stream holds the one lane, generating
            waiting = pool.submit(httpx.post, f"{base}/v1/chat/completions", json=_chat(model, 4000), timeout=60)
            time.sleep(0.5)  # it waits for the lane in the engine
            os.kill(engine, signal.SIGKILL)
            rest = list(frames)
            queued = waiting.result()
        assert rest[-1]["error"]["code"] == "engine_unavailable", rest[-3:]
        assert queued.status_code == 503 and queued.json()["error"]["code"] == "engine_unavailable"

        health = httpx.get(f"{base}/health", timeout=5)
        assert health.status_code == 503
        assert health.json()["reason"] == (
            "engine failed: the engine process was killed by SIGKILL; restarting (attempt 1 of 3)"
        )
        deadline = time.monotonic() + 120
        while httpx.get(f"{base}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the engine was not restarted in 120 s"
            time.sleep(0.2)
        assert engine_process_of(process.pid) != engine
        sdk = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        reply = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
    finally:
        process.send_signal(signal.SIGTERM)
        exit_code = stopped(process)
    assert exit_code == 0
    log = process.stderr.read()
    assert "ERROR engine failed: the engine process was killed by SIGKILL; restarting (attempt 1 of 3)" in log
    assert "INFO engine restarted in " in log


@pytest.mark.slow
def test_a_stop_signal_during_a_restart_stops_the_server_at_once(tiny_qwen):
    process, base = start_ninfer_serve(tiny_qwen)
    try:
        os.kill(engine_process_of(process.pid), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "the engine's death was not noticed"
            time.sleep(0.05)
        replacement = None  # loading: a restart takes seconds even on a tiny model
        while replacement is None:
            assert time.monotonic() < deadline, "no engine process was started again"
            with contextlib.suppress(LookupError):
                replacement = engine_process_of(process.pid)
        started = time.monotonic()
    finally:
        process.send_signal(signal.SIGTERM)
        exit_code = stopped(process)
    assert exit_code == 0
    assert time.monotonic() - started < 15  # a normal stop takes about 5 s on 2 cores
    assert wait_gone(replacement, 5), "the engine being started outlived the server"
    log = process.stderr.read()
    assert "restarting (attempt 1 of 3)" in log and "engine restarted" not in log and "stopped" in log


def stopped(process: subprocess.Popen) -> int:
    """The server's exit code once it has stopped; killed (and the test failed) if it takes 30 s."""
    try:
        return process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
