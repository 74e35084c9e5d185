"""The API process imports neither torch nor any ninfer.engine module: the engine process is started
by name and is the only one that loads them (the start-up checks that need the model run there).

Each case runs in a fresh interpreter, since this test process has imported both long since."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ninfer.artifact.packer import pack
from tests.net import ROOT, free_port

FORBIDDEN = """
import sys

def forbidden():
    return sorted(m for m in sys.modules if m.split(".")[0] == "torch" or m.split(".")[:2] == ["ninfer", "engine"])
"""

# ninfer-serve's own path (serve_main: options, port, engine client, artifact metadata beside the
# engine's start) up to where the engine process would be spawned; then the uvicorn app, as the
# API process builds it once the engine is ready.
SERVE_UNTIL_SPAWN = FORBIDDEN + """
import asyncio, json

from ninfer.server import api_process
from ninfer.server.engine_client import ProcessEngineClient
from ninfer.server.http_app import create_app


class EngineSpawn(Exception):
    pass


served = []
served_model = api_process.served_model


def recording_served_model(*args, **kwargs):
    served.append(served_model(*args, **kwargs))
    return served[-1]


async def stop_at_spawn(self):
    raise EngineSpawn(json.dumps(forbidden()))


api_process.served_model = recording_served_model
ProcessEngineClient._start_engine = stop_at_spawn

from ninfer.cli import serve_main

try:
    serve_main(sys.argv[1:])
except EngineSpawn as spawn:
    at_spawn = json.loads(str(spawn))
else:
    raise SystemExit("ninfer-serve never reached the engine's spawn")
create_app(served[0])
print(json.dumps({"at_spawn": at_spawn, "with_app": forbidden()}))
"""

# Every module of the packages the API process is made of. The media stack is imported only with
# --vision: preparing media packs bf16 patches and resizes video frames with torch.
API_PACKAGES = FORBIDDEN + """
import importlib, json, pkgutil

import ninfer.contract, ninfer.frontend, ninfer.server

VISION_ONLY = {"ninfer.server.prompt_media", "ninfer.frontend.media_expansion"}
names = ["ninfer.cli", "ninfer.config", "ninfer.log", "ninfer.artifact", "ninfer.context_cost_presets"]
for package in (ninfer.contract, ninfer.frontend, ninfer.server):
    names += [info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
for name in names:
    if name not in VISION_ONLY:
        importlib.import_module(name)
print(json.dumps({"modules": len(names), "forbidden": forbidden()}))
"""


def run_python(script: str, *args: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def container(mtp_artifact, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("container") / "tiny.ninfer"
    pack(mtp_artifact, out, progress=False)
    return str(out)


@pytest.mark.parametrize("kind", ["hf-directory", "container", "default-gguf"])
def test_ninfer_serve_imports_neither_torch_nor_the_engine_before_the_engine_starts(
    kind, mtp_artifact, container, tmp_path
):
    artifact = {"hf-directory": [mtp_artifact], "container": [container], "default-gguf": []}[kind]
    # Options whose checks need the model (speculative backend, KV format, device) are the engine's.
    options = ["--spec", "mtp", "--draft-tokens", "3", "--kv-dtype", "int8", "--device", "0"] if artifact else []
    modules = run_python(
        SERVE_UNTIL_SPAWN, *artifact, "--port", str(free_port()), *options,
        "--request-log-jsonl", str(tmp_path / "requests.jsonl"), "--api-key", "key", "--cors",
    )
    assert modules == {"at_spawn": [], "with_app": []}


def test_every_module_of_the_api_packages_imports_without_torch_or_the_engine():
    modules = run_python(API_PACKAGES)
    assert modules["modules"] > 50 and modules["forbidden"] == []
