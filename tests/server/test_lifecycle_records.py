"""Every request terminal leaves one readable stderr record, without the client's text."""

from __future__ import annotations

import logging
import re
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import fail_next_launch, serve_config, start_server, wait_until


@pytest.fixture(scope="module")
def server(tiny_qwen):
    running = start_server(serve_config(tiny_qwen, max_concurrency=1, max_context=256, default_max_tokens=8))
    yield running
    running.stop()


def test_rejected_failed_and_cancelled_requests_each_leave_a_record(server, caplog):
    model = server.serving.model_id
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    with caplog.at_level(logging.INFO, logger="ninfer.server"):
        with pytest.raises(openai.BadRequestError):
            chat.chat.completions.create(model=model, messages=[{"role": "user", "content": "pelican " * 300}])
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=30,
                          json={"model": model, "messages": [{"role": "user", "content": "pelican"}],
                                "max_tokens": 200, "stream": True}) as response:
            for _ in response.iter_lines():
                break
        # The fault must meet the next request's step, not one of the abandoned stream's.
        wait_until(lambda: not server.core.has_work, what="the abandoned stream ended in the engine")
        fail_next_launch(server)
        with pytest.raises(openai.InternalServerError):
            chat.chat.completions.create(model=model, messages=[{"role": "user", "content": "pelican"}])
        chat.chat.completions.create(model=model, messages=[{"role": "user", "content": "pelican"}])
    records = [r.getMessage() for r in caplog.records if r.name == "ninfer.server"]
    assert any("rejected (openai_chat): 400 context_length_exceeded (messages)" in r for r in records), records
    assert any("cancelled (openai_chat): the client went away" in r for r in records), records
    assert any("failed in generation (openai_chat): 500 engine_step_failed" in r for r in records), records
    assert any(" done: " in r for r in records), records
    assert not any("pelican" in r for r in records)


def test_the_done_record_counts_the_wait_for_admission_in_the_ttft(server, caplog, monkeypatch):
    """A request that arrives while the engine does idle-turn work (a step graph's capture) waits
    for it: the done line's ttft runs from the request's start, as the request log's, and names
    the wait (the prompt's own time alone once read as the ttft, hiding seconds a client saw)."""
    from ninfer.engine.core import EngineCore

    busy, jobs = threading.Event(), [0.5]

    def background_step(self) -> None:
        jobs.pop()
        busy.set()
        time.sleep(0.5)

    monkeypatch.setattr(EngineCore, "has_background_work", property(lambda self: bool(jobs)))
    monkeypatch.setattr(EngineCore, "background_step", background_step)
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)

    def ask() -> None:
        chat.chat.completions.create(model=server.serving.model_id, max_tokens=2,
                                     messages=[{"role": "user", "content": "pelican"}])

    with caplog.at_level(logging.INFO, logger="ninfer.server"):
        ask()  # an idle engine sleeps on its inbox: a request wakes it, then the idle turn starts the job
        assert busy.wait(10)
        started = time.monotonic()
        ask()
        client_seconds = time.monotonic() - started
    done = [r.getMessage() for r in caplog.records if r.name == "ninfer.server" and " done: " in r.getMessage()]
    match = re.search(r"ttft ([\d.]+)s \(admitted after ([\d.]+)s\)", done[-1])
    assert match, done
    ttft, waited = float(match.group(1)), float(match.group(2))
    assert 0.3 <= waited <= ttft <= client_seconds + 0.01, (done[-1], client_seconds)
