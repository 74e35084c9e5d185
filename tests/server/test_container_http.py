"""A server on a .ninfer container, through real sockets and the official SDKs: the public model id
is the manifest's identity.model_id (an explicit --model-id still overrides it), and greedy
answers equal those of a server on the HF directory the container was packed from."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest

from ninfer.artifact.packer import pack
from tests.net import free_port
from tests.server.conftest import serve_config, start_server

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def container(tiny_qwen, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("container") / "tiny.ninfer"
    pack(tiny_qwen, out, model_id="qwen-tiny-packed", progress=False)
    return str(out)


@pytest.fixture(scope="module")
def container_server(container):
    server = start_server(serve_config(container, default_max_tokens=12, greedy=True))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def directory_server(tiny_qwen):
    server = start_server(serve_config(tiny_qwen, default_max_tokens=12, greedy=True))
    yield server
    server.stop()


def test_the_container_identity_is_the_public_model_id(container_server) -> None:
    client = openai.OpenAI(base_url=container_server.base_url + "/v1", api_key="unused", max_retries=0)
    assert [model.id for model in client.models.list()] == ["qwen-tiny-packed"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="tiny", messages=MESSAGES)


def test_an_explicit_model_id_overrides_the_containers(container) -> None:
    server = start_server(serve_config(container, model_id="alias"))
    try:
        models = httpx.get(server.base_url + "/v1/models").json()["data"]
        assert [model["id"] for model in models] == ["alias"]
    finally:
        server.stop()


def test_greedy_answers_equal_the_source_directorys(container_server, directory_server) -> None:
    ours = openai.OpenAI(base_url=container_server.base_url + "/v1", api_key="unused", max_retries=0)
    theirs = openai.OpenAI(base_url=directory_server.base_url + "/v1", api_key="unused", max_retries=0)
    packed = ours.chat.completions.create(model="qwen-tiny-packed", messages=MESSAGES)
    source = theirs.chat.completions.create(model=directory_server.serving.model_id, messages=MESSAGES)
    assert packed.choices[0].message.content == source.choices[0].message.content
    assert packed.usage.prompt_tokens == source.usage.prompt_tokens and packed.usage.completion_tokens == 12
    claude = anthropic.Anthropic(base_url=container_server.base_url, api_key="unused", max_retries=0)
    claude_source = anthropic.Anthropic(base_url=directory_server.base_url, api_key="unused", max_retries=0)
    message = claude.messages.create(model="qwen-tiny-packed", max_tokens=12, messages=MESSAGES)
    reference = claude_source.messages.create(model=directory_server.serving.model_id, max_tokens=12, messages=MESSAGES)
    assert [block.model_dump() for block in message.content] == [block.model_dump() for block in reference.content]


@pytest.mark.skipif(shutil.which("ninfer-serve") is None, reason="ninfer-serve is not installed")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="engine process start method")
def test_ninfer_serve_serves_a_container_with_fp8_quantization(container) -> None:
    port = free_port()
    process = subprocess.Popen(
        ["ninfer-serve", container, "--port", str(port), "--quantize", "fp8", "--max-context", "256"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "ninfer-serve was not ready in 120 s"
            time.sleep(0.3)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="qwen-tiny-packed", messages=MESSAGES, max_tokens=5)
        assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    assert "--quantize fp8: 16 FP8 Linear layers (one scale per output row)" in stderr
