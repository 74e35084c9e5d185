"""Faults injected into a real ninfer-serve (NINFER_TEST_FAULTS, ninfer/engine/faults.py), a full
disk under the request log and a client that stops reading: the affected request gets a clear
error, the others finish, /health follows and the server recovers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from ninfer.engine.faults import parse_faults
from tests.net import free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /dev/full and /proc")


def test_the_fault_plan_is_parsed_strictly():
    assert parse_faults("error@3, oom@5,die@9") == {3: "error", 5: "oom", 9: "die"}
    for bad in ("error", "boom@3", "error@0", "error@x"):
        with pytest.raises(ValueError, match="NINFER_TEST_FAULTS"):
            parse_faults(bad)


class Server:
    def __init__(self, artifact: str, *args: str, faults: str | None = None):
        self.port = free_port()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        if faults:
            env["NINFER_TEST_FAULTS"] = faults
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ninfer.cli", "serve", artifact, "--port", str(self.port), *args],
            stderr=subprocess.PIPE, text=True, env=env,
        )
        self.base_url = f"http://127.0.0.1:{self.port}"
        assert self.wait_health(200, timeout=120), "the server did not become ready"
        self.client = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="x", max_retries=0)
        self.model = self.client.models.list().data[0].id

    def health(self) -> int | None:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=2).status_code
        except httpx.HTTPError:
            return None

    def wait_health(self, status: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.health() == status:
                return True
            time.sleep(0.05)
        return False

    def ask(self, max_tokens: int, **extra):
        return self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "hello"}], max_tokens=max_tokens, **extra
        )

    def stop(self) -> str:
        self.process.terminate()
        _, stderr = self.process.communicate(timeout=60)
        return stderr


@pytest.mark.slow
def test_an_out_of_memory_step_fails_its_request_and_the_server_goes_on(tiny_qwen):
    server = Server(tiny_qwen, faults="oom@3")
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            server.ask(max_tokens=8)  # its third step runs out of memory
        assert caught.value.body["code"] == "engine_step_failed"
        assert "out-of-memory" in caught.value.body["message"]
        assert server.health() == 200
        assert server.ask(max_tokens=4).choices[0].finish_reason in ("stop", "length")
    finally:
        stderr = server.stop()
    assert "injected faults are active" in stderr and "the engine goes on" in stderr


@pytest.mark.slow
def test_a_dying_engine_process_is_restarted_and_the_server_recovers(tiny_qwen):
    # Without prefix reuse every launch is a forward (no capture-only steps): easy to count.
    server = Server(tiny_qwen, "--no-prefix-reuse", faults="die@3")
    try:
        with pytest.raises(openai.APIError):
            for _ in server.ask(max_tokens=8, stream=True):
                pass
        assert server.wait_health(503, timeout=10), "/health did not report the restart"
        assert server.wait_health(200, timeout=120), "the engine did not come back"
        # The restarted engine counts its launches afresh: one launch stays clear of the fault.
        assert server.ask(max_tokens=1).choices[0].finish_reason == "length"
    finally:
        stderr = server.stop()
    assert "restarting (attempt 1 of 3)" in stderr


@pytest.mark.slow
def test_a_full_disk_under_the_request_log_costs_no_request(tiny_qwen):
    server = Server(tiny_qwen, "--request-log-jsonl", "/dev/full")
    try:
        for _ in range(3):
            assert server.ask(max_tokens=3).usage.completion_tokens == 3
        assert server.health() == 200
    finally:
        stderr = server.stop()
    assert stderr.count("write failed") == 1  # logged once, then counted


@pytest.mark.slow
def test_a_client_that_stops_reading_delays_nobody_else(tiny_qwen):
    server = Server(tiny_qwen, "--max-concurrency", "2", "--default-max-tokens", "400")
    stalled = socket.create_connection(("127.0.0.1", server.port))
    try:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps({"model": server.model, "stream": True, "max_tokens": 400,
                           "messages": [{"role": "user", "content": "tell a long story"}]}).encode()
        stalled.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )  # and never reads the stream
        time.sleep(1.0)
        started = time.monotonic()
        assert server.ask(max_tokens=6).usage.completion_tokens == 6
        assert time.monotonic() - started < 20
        assert server.health() == 200
    finally:
        stalled.close()
        time.sleep(0.5)
        try:
            assert server.ask(max_tokens=2).usage.completion_tokens == 2  # its lane came back
        finally:
            server.stop()
