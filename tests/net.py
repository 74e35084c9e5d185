"""Small helpers the tests share: a free loopback port, a real `ninfer-serve` process, and loading a
benchmark script as a module."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_ninfer_serve(artifact: str, *options: str, ready_within_s: float = 120) -> tuple[subprocess.Popen, str]:
    """`ninfer-serve artifact --port <free> *options` as a process, once /health answers 200:
    (the process, its base URL). Its stderr is a pipe, shown if it exits before it is ready."""
    port = free_port()
    process = subprocess.Popen(["ninfer-serve", artifact, "--port", str(port), *options], stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_within_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.3)
    process.kill()
    raise AssertionError(f"ninfer-serve was not ready in {ready_within_s:.0f} s")


def load_script(relative_path: str, name: str):
    """A script under the repository (e.g. benchmarks/load.py) imported as module `name`."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
