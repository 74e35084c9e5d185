"""POST /v1/messages and /v1/messages/count_tokens end to end: real sockets, the official anthropic
SDK, raw httpx for SSE frame order and error envelopes."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import anthropic
import httpx
import pytest

from ninfer.server import generation as generation_module
from ninfer.server.anthropic_messages.request import parse_messages_request
from ninfer.server.errors import APIError
from ninfer.server.request_context import RequestContext
from tests.server.conftest import RunningServer, lane_held, scripted_server, serve_config, start_server, wait_until

MODEL = "claude-sonnet-local"  # any non-empty label; echoed back
QUESTION = [{"role": "user", "content": "Say something about prefix caching."}]
# This SDK version has no sampling keywords; the fields still exist on the wire.
GREEDY = {"extra_body": {"temperature": 0}}
BILLING = "x-anthropic-billing-header: cc_version=2.1.0.abc; cc_entrypoint=cli;"
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
SCRIPT = (
    "The user wants weather.\n</think>\n\nLet me check.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


def client_for(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) pairs of an SSE response; comments (keep-alive) are skipped."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: ") :])))
    return events


def total_input(usage) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


@pytest.fixture(scope="module")
def scripted(tiny_qwen) -> Iterator[RunningServer]:
    """Thinking, then text, then a tool call, on every prompt."""
    server = scripted_server(tiny_qwen, SCRIPT, max_concurrency=2)
    yield server
    server.stop()


# ---- aggregate and streaming shapes ----------------------------------------------------------


def test_aggregate_message_shape_and_usage(qwen_server):
    message = client_for(qwen_server).messages.create(model=MODEL, max_tokens=12, messages=QUESTION, **GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    assert message.stop_reason in ("end_turn", "max_tokens")
    usage = message.usage
    assert usage.cache_creation_input_tokens is None  # creation is not known to the engine
    assert usage.cache_read_input_tokens is not None and usage.cache_read_input_tokens >= 0
    assert 0 < usage.output_tokens <= 12
    assert 0 <= usage.output_tokens_details.thinking_tokens <= usage.output_tokens
    assert message.content and all(block.type in ("thinking", "text") for block in message.content)


def test_scripted_thinking_text_and_tool_use(scripted):
    message = client_for(scripted).messages.create(
        model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL]
    )
    thinking, text, call = message.content
    assert thinking.type == "thinking" and thinking.thinking == "The user wants weather." and thinking.signature
    assert text.type == "text" and text.text == "Let me check."
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert call.input == {"city": "Paris", "days": 3} and list(call.input) == ["city", "days"]
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    assert message.usage.output_tokens_details.thinking_tokens > 0


def test_stream_matches_aggregate_and_terminal_usage(scripted):
    client = client_for(scripted)
    kwargs = dict(
        model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER_TOOL]
    )
    aggregate = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    start = events[0]
    assert start.type == "message_start" and start.message.stop_reason is None and start.message.content == []
    strip = lambda blocks: [{k: v for k, v in b.to_dict().items() if k != "id"} for b in blocks]
    assert strip(streamed.content) == strip(aggregate.content)
    assert (streamed.stop_reason, streamed.stop_sequence) == (aggregate.stop_reason, aggregate.stop_sequence)
    # The terminal cumulative usage is the aggregate's; the input split was already exact at message_start.
    assert streamed.usage.output_tokens == aggregate.usage.output_tokens
    assert streamed.usage.output_tokens_details == aggregate.usage.output_tokens_details
    assert total_input(streamed.usage) == total_input(aggregate.usage)
    assert streamed.usage.input_tokens == start.message.usage.input_tokens
    assert streamed.usage.cache_read_input_tokens == start.message.usage.cache_read_input_tokens
    assert streamed.usage.cache_creation_input_tokens is None


def test_raw_sse_event_order(scripted):
    body = {
        "model": MODEL,
        "max_tokens": 200,
        "stream": True,
        "tools": [WEATHER_TOOL],
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
    }
    with httpx.stream("POST", scripted.base_url + "/v1/messages", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["request-id"].startswith("req_")
        events = sse_events(resp)
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    blocks = events[2:-2]
    # Blocks are sequential: start, deltas, stop; indexes count up from 0.
    kinds, index = [], -1
    for name, data in blocks:
        if name == "content_block_start":
            index += 1
            assert data["index"] == index
            kinds.append(data["content_block"]["type"])
        else:
            assert name in ("content_block_delta", "content_block_stop") and data["index"] == index
    assert kinds == ["thinking", "text", "tool_use"]
    thinking = [data for _, data in blocks if data.get("index") == 0]
    deltas = [d["delta"]["type"] for d in thinking if d["type"] == "content_block_delta"]
    assert set(deltas[:-1]) == {"thinking_delta"} and deltas[-1] == "signature_delta"
    assert thinking[-1]["type"] == "content_block_stop"
    tool = [data for _, data in blocks if data.get("index") == 2]
    arguments = "".join(d["delta"]["partial_json"] for d in tool if d["type"] == "content_block_delta")
    assert json.loads(arguments) == {"city": "Paris", "days": 3}
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert final["usage"]["output_tokens"] > 0 and events[0][1]["message"]["usage"]["output_tokens"] == 0


def test_stop_sequence_is_reported(scripted):
    message = client_for(scripted).messages.create(
        model=MODEL,
        max_tokens=200,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL],
        stop_sequences=["never-seen", "check"],
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "check"
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[1].text == "Let me "


def test_max_tokens_and_context_window_stop_reasons(scripted):
    client = client_for(scripted)
    short = client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    # Pad the prompt so the 1024-token context ceiling arrives a few tokens into the script.
    ceiling = scripted.serving.max_model_len
    padding = ""
    for _ in range(4):
        messages = [{"role": "user", "content": "Hi" + padding}]
        count = client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
        padding += " hello" * (ceiling - 6 - count)
    assert count == ceiling - 6
    cut = client.messages.create(model=MODEL, max_tokens=500, messages=messages)
    assert cut.stop_reason == "model_context_window_exceeded"
    assert cut.usage.output_tokens == 6 and total_input(cut.usage) == count


def test_assistant_prefill_is_continued(scripted):
    messages = [{"role": "user", "content": "Complete this."}, {"role": "assistant", "content": "Sure, here:"}]
    client = client_for(scripted)
    message = client.messages.create(model=MODEL, max_tokens=200, messages=messages)
    # The model's output continues the prefill as answer text: no new turn, no thinking block.
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == SCRIPT
    assert message.stop_reason == "end_turn"
    assert total_input(message.usage) == client.messages.count_tokens(model=MODEL, messages=messages).input_tokens


def test_tool_choice_none_keeps_calls_as_text(scripted):
    message = client_for(scripted).messages.create(
        model=MODEL,
        max_tokens=200,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "none"},
    )
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert "<tool_call>" in message.content[1].text and message.stop_reason == "end_turn"


def test_tool_result_turn_round_trip(scripted):
    client = client_for(scripted)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(model=MODEL, max_tokens=200, messages=messages, tools=[WEATHER_TOOL])
    call = first.content[-1]
    messages += [
        first.to_param(),
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 24C", "is_error": False}],
        },
    ]
    second = client.messages.create(model=MODEL, max_tokens=200, messages=messages, tools=[WEATHER_TOOL])
    assert second.stop_reason == "tool_use"
    # The replayed turn re-renders the generated tokens, so the previous request's prefix is reused.
    assert second.usage.cache_read_input_tokens >= total_input(first.usage)


# ---- prefix reuse and the billing header -----------------------------------------------------


def test_second_turn_reads_the_cache(qwen_server):
    client = client_for(qwen_server)
    history = [{"role": "user", "content": "First question?"}]
    kwargs = dict(model=MODEL, max_tokens=10, system="You are terse.", thinking={"type": "disabled"}, **GREEDY)
    first = client.messages.create(messages=history, **kwargs)
    history += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "And a follow-up?"}]
    second = client.messages.create(messages=history, **kwargs)
    assert second.usage.cache_read_input_tokens > 0
    assert (
        total_input(second.usage)
        == client.messages.count_tokens(
            model=MODEL, messages=history, system="You are terse.", thinking={"type": "disabled"}
        ).input_tokens
    )


def test_billing_header_is_consumed_and_keeps_the_cache_hit(qwen_server):
    client = client_for(qwen_server)

    def system(header: str) -> list[dict]:
        return [
            {"type": "text", "text": header, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "You are a careful coding agent. " * 8, "cache_control": {"type": "ephemeral"}},
        ]

    prompt = dict(
        model=MODEL, messages=[{"role": "user", "content": "List three prime numbers."}], thinking={"type": "disabled"}
    )
    plain = client.messages.count_tokens(system=system("")[1:], **prompt)
    for header in (BILLING, BILLING.replace("2.1.0.abc", "2.1.1.def")):
        assert client.messages.count_tokens(system=system(header), **prompt).input_tokens == plain.input_tokens
    # Positional rule: the same text as a string-form system is ordinary content.
    as_string = client.messages.count_tokens(system=BILLING, **prompt)
    assert as_string.input_tokens > client.messages.count_tokens(**prompt).input_tokens

    kwargs = dict(max_tokens=4, **prompt, **GREEDY)
    first = client.messages.create(system=system(BILLING), **kwargs)
    second = client.messages.create(system=system(BILLING.replace("2.1.0.abc", "9.9.9.zzz")), **kwargs)
    assert total_input(first.usage) == total_input(second.usage) == plain.input_tokens
    assert second.usage.cache_read_input_tokens > 0


def test_cache_control_becomes_exact_shared_prefix_frontiers(qwen_server):
    serving = qwen_server.serving
    marker = {"type": "ephemeral"}
    body = {
        "model": MODEL,
        "tools": [{**WEATHER_TOOL, "cache_control": marker}],
        "system": [
            {"type": "text", "text": BILLING, "cache_control": marker},
            {"type": "text", "text": "Stable rules.", "cache_control": marker},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Question one?", "cache_control": marker},
                    {"type": "text", "text": " And two?"},
                ],
            }
        ],
    }
    parsed = parse_messages_request(body, RequestContext(serving.model_id, serving.capabilities, 64))
    prepared = serving.prompt_builder.build(parsed.conversation)
    frontiers = [hint.frontier for hint in prepared.capture_hints if hint.path == "shared_stable_prefix"]
    prefixes = [serving.artifact.tokenizer.decode(prepared.token_ids[:frontier]) for frontier in frontiers]
    # One frontier per kept marker (the billing block's went with it); the tool's lies inside its definition.
    assert len(frontiers) == 3 and frontiers == sorted(frontiers)
    assert "Weather for a city" in prefixes[0] and "Stable rules." not in prefixes[0]
    assert prefixes[1].endswith("Stable rules.") and BILLING not in prefixes[1]
    assert prefixes[2].endswith("Question one?")


def test_count_tokens_equals_create_input_accounting(qwen_server):
    client = client_for(qwen_server)
    cases = [
        dict(messages=QUESTION),
        dict(messages=QUESTION, system="Be brief.", tools=[WEATHER_TOOL], thinking={"type": "disabled"}),
        dict(messages=[*QUESTION, {"role": "assistant", "content": "Prefix caching"}]),
        dict(
            messages=[
                {"role": "user", "content": "a"},
                {"role": "system", "content": "Switch to French."},
                {"role": "user", "content": "b"},
            ],
            cache_control={"type": "ephemeral"},
        ),
    ]
    for case in cases:
        count = client.messages.count_tokens(model=MODEL, **case).input_tokens
        message = client.messages.create(model=MODEL, max_tokens=2, **case)
        assert total_input(message.usage) == count, case
    # Thinking mode changes the generation prompt, and count_tokens sees it.
    on = client.messages.count_tokens(model=MODEL, messages=QUESTION, thinking={"type": "adaptive"})
    off = client.messages.count_tokens(model=MODEL, messages=QUESTION, thinking={"type": "disabled"})
    assert on.input_tokens != off.input_tokens


# ---- errors ----------------------------------------------------------------------------------


def _post(server: RunningServer, body: dict, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
DOCUMENT = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}}
CITATION = {"type": "char_location", "cited_text": "x", "document_index": 0, "start_char_index": 0, "end_char_index": 1}
REDACTED_HISTORY = [
    {"role": "user", "content": "Q"},
    {
        "role": "assistant",
        "content": [{"type": "redacted_thinking", "data": "EmwKAhgB"}, {"type": "text", "text": "A"}],
    },
    {"role": "user", "content": "Next"},
]
FIVE_MARKERS = [{"type": "text", "text": f"s{i}", "cache_control": {"type": "ephemeral"}} for i in range(5)]
# (body changes, param, code, also rejected by count_tokens: False for output-only fields)
REJECTIONS = [
    ({"model": ""}, "model", "invalid_value", True),
    ({"model": None}, "model", "missing_required_parameter", True),
    ({"max_tokens": 0}, "max_tokens", "unsupported_parameter", False),
    ({"max_tokens": -1}, "max_tokens", "invalid_value", False),
    ({"temperature": 1.5}, "temperature", "invalid_value", False),
    ({"top_k": 50}, "top_k", "unsupported_parameter", False),
    ({"stop_sequences": [""]}, "stop_sequences[0]", "invalid_value", False),
    ({"messages": []}, "messages", "invalid_value", True),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "invalid_value", True),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, "messages[0].content[0]", "vision_disabled", True),
    ({"messages": [{"role": "user", "content": [DOCUMENT]}]}, "messages[0].content[0]", "unsupported_parameter", True),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "search_result", "source": "s", "title": "t", "content": []}]}
            ]
        },
        "messages[0].content[0]",
        "unsupported_parameter",
        True,
    ),
    ({"messages": REDACTED_HISTORY}, "messages[1].content[0]", "unsupported_parameter", True),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [CITATION]}]}]},
        "messages[0].content[0].citations",
        "unsupported_parameter",
        True,
    ),
    ({"tools": [{**WEATHER_TOOL, "strict": "yes"}]}, "tools[0].strict", "invalid_type", True),
    (
        {"tools": [{**WEATHER_TOOL, "allowed_callers": ["code_execution_20250825"]}]},
        "tools[0].allowed_callers",
        "unsupported_parameter",
        True,
    ),
    (
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        "tools[0].type",
        "unsupported_parameter",
        True,
    ),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type", "unsupported_parameter", True),
    (
        {"tools": [{"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}]},
        "tools[0].type",
        "unsupported_parameter",
        True,
    ),
    (
        {"tools": [{"type": "computer_20250124", "name": "computer", "display_width_px": 1, "display_height_px": 1}]},
        "tools[0].type",
        "unsupported_parameter",
        True,
    ),
    ({"tools": [{"type": "mcp_toolset", "mcp_server_name": "s"}]}, "tools[0].type", "unsupported_parameter", True),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].name", "invalid_value", True),
    (
        {"tools": [{**WEATHER_TOOL, "input_schema": {"type": "string"}}]},
        "tools[0].input_schema.type",
        "invalid_value",
        True,
    ),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema", "missing_required_parameter", True),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "invalid_value", True),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name", "invalid_value",
     True),
    (
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
        "tool_choice.disable_parallel_tool_use",
        "invalid_type",
        True,
    ),
    (
        {"mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "m"}]},
        "mcp_servers",
        "unsupported_parameter",
        True,
    ),
    ({"container": "container_abc"}, "container", "unsupported_parameter", True),
    (
        {"output_config": {"format": {"type": "json_schema"}}},
        "output_config.format.schema",
        "missing_required_parameter",
        True,
    ),
    ({"output_format": {"type": "json_object"}}, "output_format.type", "invalid_value", True),
    (
        {"thinking": {"type": "enabled", "budget_tokens": 512}, "max_tokens": 4096},
        "thinking.budget_tokens",
        "invalid_value",
        True,
    ),
    (
        {"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 2048},
        "thinking.budget_tokens",
        "invalid_value",
        False,
    ),
    ({"system": FIVE_MARKERS}, "cache_control", "invalid_value", True),
    ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "cache_control.ttl", "invalid_value", True),
]


@pytest.mark.parametrize("changes, param, code, counted", REJECTIONS, ids=[r[1] + ":" + r[2] for r in REJECTIONS])
def test_rejections_name_the_field_in_anthropic_envelope(qwen_server, changes, param, code, counted):
    body = {"model": MODEL, "max_tokens": 8, "messages": QUESTION, **changes}
    body = {k: v for k, v in body.items() if v is not None}
    # The envelope has no code member, so the exact (param, code) is read from the parser itself.
    context = qwen_server.serving.request_context
    with pytest.raises(APIError) as err:
        parse_messages_request(body, context)
    assert (err.value.param, err.value.code) == (param, code)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        if path.endswith("count_tokens") and not counted:
            assert _post(qwen_server, body, path).status_code == 200  # output-only fields do not affect a count
            continue
        resp = _post(qwen_server, body, path)
        assert resp.status_code == 400, (path, resp.text)
        error = resp.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert param in error["error"]["message"]
        assert error["request_id"] == resp.headers["request-id"]


def test_advisory_fields_and_headers_are_ignored(qwen_server):
    body = {
        "model": "any-label-at-all",
        "max_tokens": 2,
        "messages": QUESTION,
        "metadata": {"user_id": "u-1"},
        "service_tier": "auto",
        "inference_geo": "eu",
        "speed": "standard",
        "some_future_hint": {"x": 1},
        "top_k": 0,
        "tool_choice": {"type": "auto"},
        "tools": [{**WEATHER_TOOL, "input_examples": [{"city": "Oslo"}], "eager_input_streaming": True}],
    }
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "prompt-caching-2024-07-31,interleaved-thinking"}
    resp = httpx.post(qwen_server.base_url + "/v1/messages", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200 and resp.json()["model"] == "any-label-at-all"


def test_request_ids_and_error_bodies(qwen_server):
    client = client_for(qwen_server)
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=2, messages=QUESTION)
    ok_id = raw.headers["request-id"]
    assert ok_id.startswith("req_") and raw.parse().stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model=MODEL, max_tokens=2, messages=QUESTION, tool_choice={"type": "tool", "name": "other"},
            tools=[WEATHER_TOOL],
        )
    bad = err.value
    assert bad.request_id == bad.body["request_id"] and bad.request_id != ok_id
    assert bad.body["error"]["type"] == "invalid_request_error"
    resp = _post(qwen_server, {"model": MODEL, "messages": QUESTION}, "/v1/messages/count_tokens")
    assert list(resp.json()) == ["input_tokens"] and resp.json()["input_tokens"] > 0
    assert resp.headers["request-id"].startswith("req_") and resp.headers["request-id"] != ok_id
    resp = _post(qwen_server, {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x" * 20000}]})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert "context" in resp.json()["error"]["message"] and resp.json()["request_id"] == resp.headers["request-id"]
    garbage = httpx.post(
        qwen_server.base_url + "/v1/messages", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert garbage.status_code == 400 and garbage.json()["request_id"] == garbage.headers["request-id"]


def test_error_after_the_stream_started_is_an_error_event(qwen_server, monkeypatch):
    original = generation_module.Generation.events

    async def failing(self):
        async for event in original(self):
            yield event
            raise APIError(500, "the engine failed; see the server log", code="engine_failure", type="server_error")

    monkeypatch.setattr(generation_module.Generation, "events", failing)
    body = {"model": MODEL, "max_tokens": 8, "stream": True, "messages": QUESTION}
    with httpx.stream("POST", qwen_server.base_url + "/v1/messages", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        request_id = resp.headers["request-id"]
        events = sse_events(resp)
    assert events[0][0] == "message_start" and events[-1][0] == "error"
    assert events[-1][1] == {
        "type": "error",
        "request_id": request_id,
        "error": {"type": "api_error", "message": "the engine failed; see the server log"},
    }
    assert "message_stop" not in [name for name, _ in events]
    client = client_for(qwen_server)
    with (
        pytest.raises(anthropic.APIStatusError) as err,
        client.messages.stream(model=MODEL, max_tokens=8, messages=QUESTION) as stream,
    ):
        list(stream)
    assert err.value.body["error"]["type"] == "api_error"


def test_client_disconnect_cancels_the_stream(qwen_server):
    body = {"model": MODEL, "max_tokens": 900, "stream": True, "messages": QUESTION}
    with httpx.stream("POST", qwen_server.base_url + "/v1/messages", json=body, timeout=60) as resp:
        next(resp.iter_lines())
    deadline = time.time() + 20
    while qwen_server.core.pool_accounting()["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert qwen_server.core.pool_accounting()["running"] == 0


@pytest.fixture(scope="module")
def guarded(tiny_qwen) -> Iterator[RunningServer]:
    """One lane, one waiting place, a short admission deadline, and an API key."""
    server = start_server(
        serve_config(
            tiny_qwen,
            max_concurrency=1,
            max_pending_requests=1,
            pending_timeout_ms=3000,
            max_context=8192,
            api_key="sekret",
        )
    )
    yield server
    server.stop()


def test_x_api_key_authentication(guarded):
    message = anthropic.Anthropic(base_url=guarded.base_url, api_key="sekret", max_retries=0).messages.create(
        model=MODEL, max_tokens=2, messages=QUESTION
    )
    assert message.usage.output_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=guarded.base_url, api_key="wrong", max_retries=0).messages.count_tokens(
            model=MODEL, messages=QUESTION
        )
    assert err.value.body["error"]["type"] == "authentication_error"
    assert err.value.body["request_id"] == err.value.request_id


@pytest.mark.slow
def test_overload_is_529_and_queue_timeout_is_504(guarded):
    client = anthropic.Anthropic(base_url=guarded.base_url, api_key="sekret", max_retries=0)
    engine = guarded.serving.engine
    holder = {"model": MODEL, "max_tokens": 5000, "stream": True, "messages": QUESTION}
    with lane_held(guarded, "/v1/messages", holder, headers={"x-api-key": "sekret"}):
        waited: dict = {}

        def wait_in_queue() -> None:
            try:
                client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION)
            except anthropic.APIStatusError as exc:
                waited["error"] = exc

        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        wait_until(lambda: engine.num_outstanding == engine.capacity, what="the waiter's place")
        with pytest.raises(anthropic.OverloadedError) as over:
            client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION)
        assert over.value.status_code == 529 and over.value.body["error"]["type"] == "overloaded_error"
        assert over.value.body["request_id"] == over.value.request_id
        waiter.join(60)
        timeout = waited["error"]
        assert isinstance(timeout, anthropic.GatewayTimeoutError) and timeout.status_code == 504
        assert timeout.body["error"]["type"] == "timeout_error"


@pytest.mark.slow
def test_enabled_thinking_budget_reaches_the_engine(tiny_qwen):
    server = scripted_server(tiny_qwen, "thinking " * 1100, max_context=4096)
    try:
        client = client_for(server)
        kwargs = dict(model=MODEL, max_tokens=1100, messages=[{"role": "user", "content": "Hi"}])
        capped = client.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kwargs)
        thinking, text = capped.content
        assert thinking.thinking.endswith("I have to give the solution based on the thinking directly now.")
        assert text.text.startswith("thinking thinking")
        assert 1024 < capped.usage.output_tokens_details.thinking_tokens < 1100
        adaptive = client.messages.create(thinking={"type": "adaptive"}, **kwargs)
        assert [b.type for b in adaptive.content] == ["thinking"]  # no cap: the whole output is reasoning
        assert "Considering the limited time" not in adaptive.content[0].thinking
        assert adaptive.stop_reason == "max_tokens"
    finally:
        server.stop()
