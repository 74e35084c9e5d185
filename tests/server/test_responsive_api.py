"""The API process stays responsive while a large request is parsed, rendered and tokenized:
that work runs on worker threads, not on the event loop."""

from __future__ import annotations

import statistics
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
    words = "agent build test file function value error result path config server request " * 80_000
    body = {"model": server.serving.model_id, "messages": [{"role": "user", "content": words}], "max_tokens": 4}
    assert len(words) > 6_000_000
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
    # With that work on the event loop every probe sent meanwhile waits for all of it.
    assert len(health_seconds) >= 3, f"only {len(health_seconds)} probes answered in {result['seconds']:.2f} s"
    typical = statistics.median(health_seconds)
    assert typical < 0.1, f"/health typically waited {typical:.3f} s (all: {health_seconds})"
    # Holding the GIL through a tokenizer call stalled one probe for the whole encode (3.8 s at 6 MB).
    assert max(health_seconds) < 0.5, f"/health waited {max(health_seconds):.3f} s once (all: {health_seconds})"
