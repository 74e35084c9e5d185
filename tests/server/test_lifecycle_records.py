"""Every request terminal leaves one readable stderr record, without the client's text."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

from tests.server.conftest import fail_next_launch, serve_config, start_server


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
