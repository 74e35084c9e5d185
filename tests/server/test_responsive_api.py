"""The API process stays responsive while a large request is parsed, rendered and tokenized:
that work runs on worker threads, not on the event loop."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import serve_config, start_server


@pytest.fixture(scope="module")
def server(tiny_qwen):
    running = start_server(serve_config(tiny_qwen, max_concurrency=1, max_context=1024))
    yield running
    running.stop()


def test_health_answers_in_milliseconds_while_a_large_body_is_processed(server):
    words = "agent build test file function value error result path config server request " * 40_000
    body = {"model": server.serving.model_id, "messages": [{"role": "user", "content": words}], "max_tokens": 4}
    assert len(words) > 3_000_000
    result: dict = {}

    def send_large() -> None:
        started = time.perf_counter()
        result["response"] = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)
        result["seconds"] = time.perf_counter() - started

    sender = threading.Thread(target=send_large)
    sender.start()
    health_seconds = []
    with httpx.Client(base_url=server.base_url) as client:
        while sender.is_alive():
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            health_seconds.append(time.perf_counter() - started)
            time.sleep(0.02)
    sender.join()
    response = result["response"]
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert result["seconds"] > 0.5, "the large request was too quick to show anything"
    assert len(health_seconds) >= 3
    slowest = max(health_seconds)
    assert slowest < 0.25 and slowest < result["seconds"] / 4, (
        f"/health waited {slowest:.3f} s while the large request took {result['seconds']:.2f} s"
    )
