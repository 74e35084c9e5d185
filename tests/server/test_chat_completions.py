"""POST /v1/chat/completions end to end: real sockets, the official openai SDK, raw httpx for frames."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import lane_held, scripted_server, serve_config, start_server, wait_until

QUESTION = [{"role": "user", "content": "Say something about prefix caching."}]


def client_for(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def sse_frames(response: httpx.Response) -> list[str]:
    """The data payloads of an SSE response, keep-alive comments excluded."""
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_health_models_and_lookup(qwen_server):
    base = qwen_server.base_url
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    client = client_for(qwen_server)
    models = client.models.list().data
    assert [m.id for m in models] == [qwen_server.serving.model_id]
    assert models[0].model_extra["max_model_len"] == 1024
    assert client.models.retrieve(qwen_server.serving.model_id).id == qwen_server.serving.model_id
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("some-other-model")
    assert err.value.body["code"] == "model_not_found"


def test_aggregate_response_usage_and_timings(qwen_server):
    client = client_for(qwen_server)
    resp = client.chat.completions.create(model=qwen_server.serving.model_id, messages=QUESTION, max_tokens=12, seed=5)
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.logprobs is None and choice.message.refusal is None
    usage = resp.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.completion_tokens <= 12
    assert usage.prompt_tokens_details.cached_tokens == 0 or usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    reasoning = usage.completion_tokens_details.reasoning_tokens
    assert 0 <= reasoning <= usage.completion_tokens
    timings = resp.model_extra["timings"]
    assert timings["cache_n"] + timings["prompt_n"] == usage.prompt_tokens
    assert timings["predicted_n"] == usage.completion_tokens
    for key, value in timings.items():
        assert value == value and value >= 0, key  # finite, non-negative
    if usage.completion_tokens > 1 and timings["predicted_ms"] > 0:
        expected = (usage.completion_tokens - 1) * 1000.0 / timings["predicted_ms"]
        assert timings["predicted_per_second"] == pytest.approx(expected)


def test_a_text_only_request_with_an_audio_configuration_is_served(qwen_server):
    client = client_for(qwen_server)
    model = qwen_server.serving.model_id
    resp = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, seed=5, modalities=["text"],
                                          audio={"voice": "alloy", "format": "wav"})
    assert resp.choices[0].message.audio is None and resp.usage.completion_tokens <= 2
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, modalities=["text", "audio"],
                                       audio={"voice": "alloy", "format": "wav"})
    assert refused.value.body["param"] == "modalities"


def test_stream_equals_aggregate_for_same_seed(qwen_server):
    client = client_for(qwen_server)
    model = qwen_server.serving.model_id
    kwargs = dict(model=model, messages=QUESTION, max_tokens=16, seed=1234, temperature=0.9)
    aggregate = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
    message = aggregate.choices[0].message
    assert content == (message.content or "")
    assert reasoning == message.model_extra.get("reasoning_content", "")
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == aggregate.choices[0].finish_reason
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == aggregate.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == aggregate.usage.prompt_tokens
    assert "timings" in usage_chunk.model_extra  # terminal timings ride on the last JSON chunk


def test_raw_stream_frames_done_and_request_ids(qwen_server):
    body = {"messages": QUESTION, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", qwen_server.base_url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        stream_id = resp.headers["x-request-id"]
        frames = sse_frames(resp)
    assert frames[-1] == "[DONE]"
    last_json = json.loads(frames[-2])
    assert last_json["choices"][0]["finish_reason"] is not None and "timings" in last_json
    ok = httpx.post(qwen_server.base_url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1})
    bad = httpx.post(qwen_server.base_url + "/v1/chat/completions", json={"messages": []})
    ids = {stream_id, ok.headers["x-request-id"], bad.headers["x-request-id"]}
    assert len(ids) == 3 and bad.status_code == 400


def test_second_turn_reports_cached_tokens(qwen_server):
    client = client_for(qwen_server)
    model = qwen_server.serving.model_id
    history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "First question?"}]
    first = client.chat.completions.create(model=model, messages=history, max_tokens=10, temperature=0,
                                           extra_body={"enable_thinking": False})
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And a follow-up?"},
    ]
    second = client.chat.completions.create(model=model, messages=history, max_tokens=4, temperature=0,
                                            extra_body={"enable_thinking": False})
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert second.model_extra["timings"]["cache_n"] == cached


def test_zero_max_tokens_processes_prompt_only(qwen_server):
    resp = client_for(qwen_server).chat.completions.create(
        model=qwen_server.serving.model_id, messages=QUESTION, max_completion_tokens=0
    )
    assert resp.usage.completion_tokens == 0
    assert resp.choices[0].finish_reason == "length"
    assert resp.model_extra["timings"]["predicted_n"] == 0


def test_progress_and_per_token_timings(qwen_server):
    body = {"messages": QUESTION * 3, "max_tokens": 3, "stream": True, "return_progress": True,
            "timings_per_token": True}
    with httpx.stream("POST", qwen_server.base_url + "/v1/chat/completions", json=body, timeout=60) as resp:
        frames = [json.loads(f) for f in sse_frames(resp) if f != "[DONE]"]
    progress = [f["prompt_progress"] for f in frames if "prompt_progress" in f]
    assert progress[0]["processed"] == progress[0]["cache"]
    assert progress[-1]["processed"] == progress[-1]["total"]
    assert [p["processed"] for p in progress] == sorted(p["processed"] for p in progress)
    first_delta = next(i for i, f in enumerate(frames) if f["choices"] and f["choices"][0]["delta"].get("content", "") or
                       f["choices"] and f["choices"][0]["delta"].get("reasoning_content"))
    assert all(i < first_delta for i, f in enumerate(frames) if "prompt_progress" in f)
    visible = [f for f in frames if f["choices"] and (f["choices"][0]["delta"].get("content") or
                                                      f["choices"][0]["delta"].get("reasoning_content"))]
    assert visible and all("timings" in f for f in visible)


def test_rejections_name_the_field(qwen_server):
    client = client_for(qwen_server)
    model = qwen_server.serving.model_id
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=QUESTION, top_logprobs=3)
    assert err.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=QUESTION, reasoning_effort="low")
    assert err.value.body["code"] == "reasoning_effort_not_supported"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="not-loaded", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x" * 20000}])
    assert err.value.body["code"] == "context_length_exceeded"
    resp = httpx.post(qwen_server.base_url + "/v1/chat/completions", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"


def test_omitted_model_uses_loaded_model(qwen_server):
    resp = httpx.post(qwen_server.base_url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["model"] == qwen_server.serving.model_id


@pytest.mark.slow
def test_auth_cors_and_body_limit(tiny_qwen):
    server = start_server(serve_config(tiny_qwen, api_key="sekret", cors=True, max_request_mib=1))
    try:
        base = server.base_url
        assert httpx.get(base + "/health").status_code == 200
        denied = httpx.get(base + "/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert "x-request-id" in denied.headers
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(base + "/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        preflight = httpx.options(base + "/v1/chat/completions", headers={
            "Origin": "http://example.test", "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] in ("*", "http://example.test")
        big = httpx.post(base + "/v1/chat/completions", content=b"x" * (2 << 20),
                         headers={"Authorization": "Bearer sekret", "content-type": "application/json"})
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    finally:
        server.stop()


@pytest.mark.slow
def test_overload_and_queue_timeout(tiny_qwen):
    # The waiter's deadline only has to outlast the 429 check below, which starts once it waits.
    server = start_server(serve_config(tiny_qwen, max_concurrency=1, max_pending_requests=1,
                                       pending_timeout_ms=3000, max_context=8192))
    engine = server.serving.engine
    holder = {"messages": QUESTION, "max_tokens": 5000, "stream": True}
    try:
        with lane_held(server, "/v1/chat/completions", holder):
            waiting = {}

            def wait_in_queue():
                waiting["resp"] = httpx.post(server.base_url + "/v1/chat/completions",
                                             json={"messages": QUESTION, "max_tokens": 2}, timeout=60)

            waiter = threading.Thread(target=wait_in_queue)
            waiter.start()
            wait_until(lambda: engine.num_outstanding == engine.capacity, what="the waiter's place")
            over = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2})
            assert over.status_code == 429 and over.json()["error"]["code"] == "server_overloaded"
            waiter.join(60)
            assert waiting["resp"].status_code == 503
            assert waiting["resp"].json()["error"]["code"] == "request_queue_timeout"
    finally:
        server.stop()


@pytest.mark.slow
def test_client_disconnect_cancels_the_request(tiny_qwen):
    server = start_server(serve_config(tiny_qwen, max_concurrency=1, default_max_tokens=5000, max_context=8192))
    try:
        body = {"messages": QUESTION, "max_tokens": 5000, "stream": True}
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            next(lines)
        deadline = time.time() + 20
        while server.core.pool_accounting()["running"] and time.time() < deadline:
            time.sleep(0.05)
        assert server.core.pool_accounting()["running"] == 0
        ok = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        server.stop()


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]},
    },
}
SCRIPT = (
    "The user wants weather.\n</think>\n\nLet me check.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


def test_reasoning_and_tool_calls_from_scripted_model(tiny_qwen):
    server = scripted_server(tiny_qwen, SCRIPT)
    try:
        client = client_for(server)
        kwargs = dict(model=server.serving.model_id, messages=[{"role": "user", "content": "Weather in Paris?"}],
                      tools=[WEATHER_TOOL], max_tokens=200)
        resp = client.chat.completions.create(**kwargs)
        message = resp.choices[0].message
        assert resp.choices[0].finish_reason == "tool_calls"
        assert message.model_extra["reasoning_content"] == "The user wants weather."
        assert message.content == "Let me check."
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
        assert list(json.loads(call.function.arguments)) == ["city", "days"]
        assert resp.usage.completion_tokens_details.reasoning_tokens > 0

        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        args = "".join(tc.function.arguments or "" for c in chunks if c.choices
                       for tc in (c.choices[0].delta.tool_calls or []))
        assert args == call.function.arguments
        names = [tc.function.name for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])
                 if tc.function.name]
        assert names == ["get_weather"]

        none = client.chat.completions.create(**kwargs, tool_choice="none")
        assert none.choices[0].message.tool_calls is None
        assert "<tool_call>" in none.choices[0].message.content  # calls stay text with tool_choice none
    finally:
        server.stop()


def test_thinking_budget_inserts_close_guidance(tiny_qwen):
    server = scripted_server(tiny_qwen, "thinking " * 40, default_thinking_budget=5)
    try:
        resp = client_for(server).chat.completions.create(
            model=server.serving.model_id, messages=QUESTION, max_tokens=60)
        message = resp.choices[0].message
        assert "Considering the limited time" in message.model_extra["reasoning_content"]
        assert message.model_extra["reasoning_content"].startswith("thinking thinking")
    finally:
        server.stop()


@pytest.mark.slow
def test_default_model_answers_through_the_sdk():
    server = start_server(serve_config(None, default_max_tokens=40))
    try:
        resp = client_for(server).chat.completions.create(
            model=server.serving.model_id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
        )
        assert "Paris" in resp.choices[0].message.content
        assert resp.choices[0].message.model_extra.get("reasoning_content") is None
    finally:
        server.stop()
