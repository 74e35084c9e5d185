"""The benchmarks' server helper waits for step graphs captured in idle turns before a
steady-state measurement, reading the server's log."""

from __future__ import annotations

import threading
import time

import pytest

from tests.net import load_script

serve_process = load_script("benchmarks/serve_process.py", "serve_process")
ANNOUNCED = "INFO CUDA graphs for prompt and mixed steps of 16, 24, 1032 tokens: captured while the engine is idle\n"
DONE = "INFO CUDA graphs captured for prompt and mixed steps of 16, 24, 1032 tokens in 7.5 s, while idle\n"


def test_it_waits_until_the_idle_captures_are_logged_done(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(ANNOUNCED)
    threading.Timer(0.3, lambda: log.write_text(ANNOUNCED + "INFO request r done\n" + DONE)).start()
    started = time.monotonic()
    waited = serve_process.wait_for_step_graphs(log, timeout=10, poll_s=0.05)
    assert 0.25 <= waited <= time.monotonic() - started


def test_nothing_to_wait_for_without_idle_captures(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO CUDA graphs captured for prompt and mixed steps of 16, 24 tokens in 4.3 s\n")  # at start-up
    assert serve_process.wait_for_step_graphs(log, timeout=10) == 0.0


def test_a_server_that_never_finishes_them_is_reported(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(ANNOUNCED)
    with pytest.raises(SystemExit, match="not captured within"):
        serve_process.wait_for_step_graphs(log, timeout=0.2, poll_s=0.05)
