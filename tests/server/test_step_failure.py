"""A step that fails on the device ends only its requests, with a clear error; the server goes on."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import fail_next_launch, serve_config, start_server


@pytest.fixture(scope="module")
def server(tiny_qwen):
    running = start_server(serve_config(tiny_qwen, max_concurrency=2, default_max_tokens=8))
    yield running
    running.stop()


def ask(client: openai.OpenAI, **extra):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0, **extra
    )


def test_the_failed_request_gets_a_clear_error_and_the_next_one_is_served(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    before = ask(client).choices[0].message.content
    fail_next_launch(server, "CUDA out of memory (simulated)")
    with pytest.raises(openai.InternalServerError) as caught:
        ask(client)
    error = caught.value.body
    assert error["code"] == "engine_step_failed" and error["type"] == "server_error"
    assert "CUDA out of memory (simulated)" in error["message"] and "retry" in error["message"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert ask(client).choices[0].message.content == before  # same greedy answer as before the fault


def test_a_stream_ends_with_the_protocol_error_event(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    fail_next_launch(server, "CUDA out of memory (simulated)")
    with pytest.raises(openai.APIError) as caught:
        for _ in ask(client, stream=True):
            pass
    assert caught.value.body["code"] == "engine_step_failed" and "CUDA out of memory" in caught.value.message
    assert ask(client).choices[0].finish_reason in ("stop", "length")
