"""What the HTTP benchmarks (agent_loop.py, load.py) share: starting and stopping ninfer-serve as a
subprocess whose stderr goes to a log file, and random-word prompts of about a given token count.

Imported by the scripts beside it (`python3 benchmarks/X.py` puts this folder on sys.path).
"""

from __future__ import annotations

import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

WORDS = (
    "agent build test file function value error result path config server request response cache "
    "token model layer state page slot memory thread queue batch stream index table record field "
    "option default update commit branch merge review check output input source target module "
    "package import export parse render format string number list array object class method"
).split()
TOKENS_PER_WORD = 1.1  # the Qwen3.5 tokenizer on words() output, measured


def words(rng: random.Random, num_tokens: int) -> str:
    count = max(1, int(num_tokens / TOKENS_PER_WORD))
    out = []
    for i in range(count):
        out.append(rng.choice(WORDS))
        if i % 12 == 11:
            out.append(".\n" if i % 48 == 47 else ",")
    return " ".join(out)


def start_server(
    serve_command: list[str], model: str, server_args: list[str], port: int, log_path: Path, ready_timeout: float,
    poll_s: float = 1.0,
) -> subprocess.Popen:
    """Start the server and return once /health answers 200 (polled every poll_s)."""
    command = [*serve_command, model, "--port", str(port), *server_args]
    print(f"$ {shlex.join(command)}  (log: {log_path})", file=sys.stderr, flush=True)
    # Its own process group, so stopping it also stops the engine process it spawned.
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"),  # noqa: SIM115
                               start_new_session=True)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"ninfer-serve exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    process.terminate()
    raise SystemExit(f"ninfer-serve was not ready within {ready_timeout:.0f}s; see {log_path}")


STEP_GRAPHS_PENDING = "captured while the engine is idle"  # the engine's start announces idle captures
STEP_GRAPHS_DONE = re.compile(r"CUDA graphs captured for prompt and mixed steps of .* in [\d.]+ s, while idle")


def wait_for_step_graphs(log_path: Path, timeout: float = 180.0, poll_s: float = 0.5) -> float:
    """A server ready before its prompt-step graphs exist captures them in idle turns (after a
    short grace): wait until its log says they are all captured, so a steady-state measurement
    does not meet a capture. -> seconds waited (0 when none were pending)."""
    started = time.monotonic()
    if STEP_GRAPHS_PENDING not in log_path.read_text(errors="replace"):
        return 0.0
    while time.monotonic() - started < timeout:
        if STEP_GRAPHS_DONE.search(log_path.read_text(errors="replace")):
            waited = time.monotonic() - started
            print(f"step graphs captured ({waited:.1f} s after asking)", file=sys.stderr, flush=True)
            return waited
        time.sleep(poll_s)
    raise SystemExit(f"the server's step graphs were not captured within {timeout:.0f}s; see {log_path}")


def stop_server(process: subprocess.Popen) -> None:
    """Stop the server (it stops its engine process), then anything left in its process group;
    wait until they are gone (GPU memory freed)."""
    group = os.getpgid(process.pid)
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)  # anyone left?
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.killpg(group, signal.SIGKILL)
    process.wait()
