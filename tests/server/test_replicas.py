"""Replicas behind a router: every generation response names its conversation's routing key
(prompt_cache_key, Anthropic metadata.user_id, a stored Responses chain's root) and Responses name
their id, in headers; behind HAProxy with docs/replicas/haproxy.cfg, two servers keep each
conversation on one replica, whose cache serves its later turns, and every Responses follow-up
finds its stored parent."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from ninfer.server.routing_key import RESPONSE_ID_HEADER, ROUTING_KEY_HEADER
from tests.server.conftest import serve_config, start_server

HAPROXY_CONFIG = Path(__file__).resolve().parents[2] / "docs" / "replicas" / "haproxy.cfg"
QUESTION = [{"role": "user", "content": "Say something about replicas."}]


def _openai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def test_responses_name_their_routing_key(qwen_server) -> None:
    client, model = _openai(qwen_server.base_url), qwen_server.serving.model_id
    chat = client.chat.completions.with_raw_response.create(
        model=model, messages=QUESTION, max_tokens=4, prompt_cache_key="session-7f3a"
    )
    assert chat.headers[ROUTING_KEY_HEADER] == "session-7f3a"
    streamed = client.chat.completions.with_raw_response.create(
        model=model, messages=QUESTION, max_tokens=4, prompt_cache_key="session-7f3a", stream=True
    )
    assert streamed.headers[ROUTING_KEY_HEADER] == "session-7f3a"
    plain = client.chat.completions.with_raw_response.create(model=model, messages=QUESTION, max_tokens=4)
    assert ROUTING_KEY_HEADER not in plain.headers
    # A key a header cannot carry as sent travels as its digest.
    unicode_key = client.chat.completions.with_raw_response.create(
        model=model, messages=QUESTION, max_tokens=4, prompt_cache_key="sesión 1"
    )
    assert unicode_key.headers[ROUTING_KEY_HEADER].startswith("sha256:")

    messages = anthropic.Anthropic(base_url=qwen_server.base_url, api_key="unused", max_retries=0)
    reply = messages.messages.with_raw_response.create(
        model="any", max_tokens=4, messages=QUESTION, metadata={"user_id": "user_abc_session_42"}
    )
    assert reply.headers[ROUTING_KEY_HEADER] == "user_abc_session_42"
    with pytest.raises(anthropic.BadRequestError, match="metadata.user_id"):
        messages.messages.create(model="any", max_tokens=4, messages=QUESTION, metadata={"user_id": 42})


def test_a_responses_chain_keeps_its_roots_key(qwen_server) -> None:
    client, model = _openai(qwen_server.base_url), qwen_server.serving.model_id
    first = client.responses.with_raw_response.create(model=model, input="Hello.", max_output_tokens=4)
    root_key = first.headers[ROUTING_KEY_HEADER]
    assert first.headers[RESPONSE_ID_HEADER] == first.parse().id
    second = client.responses.with_raw_response.create(
        model=model, input="And then?", previous_response_id=first.parse().id, max_output_tokens=4, stream=True
    )
    assert second.headers[ROUTING_KEY_HEADER] == root_key
    keyed = client.responses.with_raw_response.create(
        model=model, input="Hello.", max_output_tokens=4, prompt_cache_key="codex-session-1"
    )
    assert keyed.headers[ROUTING_KEY_HEADER] == "codex-session-1"
    unstored = client.responses.with_raw_response.create(model=model, input="Hello.", max_output_tokens=4, store=False)
    assert ROUTING_KEY_HEADER not in unstored.headers and unstored.headers[RESPONSE_ID_HEADER] == unstored.parse().id


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _requests_started(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("ninfer:requests_started_total"))


@pytest.fixture(scope="module")
def proxied(tiny_qwen):
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed: `bash scripts/install.sh --test` installs Debian's haproxy (as root)")
    replicas = [start_server(serve_config(tiny_qwen, max_concurrency=2, default_max_tokens=8)) for _ in range(2)]
    port = _free_port()
    env = {**os.environ, "NINFER_PROXY_BIND": f"127.0.0.1:{port}",
           **{f"NINFER_REPLICA_{i + 1}": f"127.0.0.1:{r.port}" for i, r in enumerate(replicas)}}  # fmt: skip
    proxy = subprocess.Popen(["haproxy", "-f", str(HAPROXY_CONFIG)], env=env, stderr=subprocess.PIPE)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            httpx.get(base_url + "/health", timeout=1)
            break
        except httpx.TransportError:
            if proxy.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"haproxy did not start: {proxy.stderr.read().decode() if proxy.stderr else ''}")
            time.sleep(0.1)
    yield base_url, [r.base_url for r in replicas], replicas[0].serving.model_id
    proxy.terminate()
    proxy.wait(10)
    for replica in replicas:
        replica.stop()


def test_a_conversation_stays_on_one_replica_and_reuses_its_cache(proxied) -> None:
    base_url, replicas, model = proxied
    client = _openai(base_url)
    for session in range(4):
        before = [_requests_started(r) for r in replicas]
        messages = [{"role": "user", "content": f"Conversation {session}: tell me about caches. " * 8}]
        cached = []
        for turn in range(3):
            reply = client.chat.completions.create(
                model=model, messages=messages, max_tokens=8, temperature=0, prompt_cache_key=f"agent-{session}"
            )
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or "ok"},
                         {"role": "user", "content": f"Turn {turn + 1}: go on."}]  # fmt: skip
        served = [_requests_started(r) - b for r, b in zip(replicas, before)]
        assert sorted(served) == [0, 3], f"conversation {session} spread over replicas: {served}"
        assert all(tokens > 0 for tokens in cached[1:]), f"later turns recomputed their history: {cached}"


def test_responses_follow_ups_find_their_parent_on_its_replica(proxied) -> None:
    """Without a key, new chains spread round robin; each follow-up must reach the replica that
    stored its parent, or it would be a 404 response_not_found."""
    base_url, replicas, model = proxied
    client = _openai(base_url)
    before = [_requests_started(r) for r in replicas]
    for chain in range(4):
        previous = client.responses.create(model=model, input=f"Chain {chain}.", max_output_tokens=4)
        for _ in range(2):
            previous = client.responses.create(
                model=model, input="More.", previous_response_id=previous.id, max_output_tokens=4
            )
    served = [_requests_started(r) - b for r, b in zip(replicas, before)]
    assert sum(served) == 12 and min(served) > 0, f"the chains did not spread over both replicas: {served}"
