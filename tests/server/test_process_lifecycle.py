"""ninfer-serve as a process: a stop signal stops both processes and exits 0, the engine process
never outlives the API process however that one dies, and a busy port fails before the model
loads with one clear line."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from ninfer.testing.processes import engine_process_of
from tests.net import start_ninfer_serve

pytestmark = [
    pytest.mark.slow,  # each case starts a server process
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.skipif(shutil.which("ninfer-serve") is None, reason="ninfer-serve is not installed"),
]






def running(pid: int) -> bool:
    try:
        return "State:\tZ" not in open(f"/proc/{pid}/status").read()
    except OSError:
        return False


def wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not running(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_both_processes(tiny_qwen, stop):
    process, _ = start_ninfer_serve(tiny_qwen)
    engine = engine_process_of(process.pid)
    process.send_signal(stop)
    assert process.wait(timeout=60) == 0
    assert wait_gone(engine, 5), "the engine process outlived the server"
    log = process.stderr.read()
    assert "shutting down" in log and "stopped" in log and "Traceback" not in log


def test_the_engine_process_dies_with_a_killed_server(tiny_qwen):
    process, _ = start_ninfer_serve(tiny_qwen)
    engine = engine_process_of(process.pid)
    process.kill()  # SIGKILL: no handler runs in the API process
    process.wait(timeout=30)
    assert wait_gone(engine, 10), "the engine process outlived a killed server"


def test_a_dead_engine_process_fails_requests_instead_of_hanging_and_the_server_still_stops(tiny_qwen):
    process, base = start_ninfer_serve(tiny_qwen)
    os.kill(engine_process_of(process.pid), signal.SIGKILL)
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    deadline = time.monotonic() + 30
    while True:  # the engine's death is noticed within about a second
        response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        if response.status_code == 503 or time.monotonic() > deadline:
            break
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def test_a_busy_port_fails_before_the_model_loads(tiny_qwen):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(["ninfer-serve", tiny_qwen, "--port", str(port)], capture_output=True, text=True,
                                timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"ninfer-serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    assert "Traceback" not in result.stderr and "model loaded" not in result.stderr
    assert time.monotonic() - started < 60
