"""The documented compatibility rules for agent clients, each checked end to end.

Codex (Responses) and Claude Code (Messages) send fields on every request that ask for
something NInfer cannot give literally; each rule serves the closest faithful behaviour:
reasoning returned in a reversible envelope that round-trips, hosted tools left out of the
prompt, verbosity as a hint, the nearest effort tier, thinking without display, deferred
tools rendered at once, and Retry-After on capacity refusals. Plus the rules every protocol
applies the same way (tools a template cannot render, the vision switch's message).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from ninfer.server.anthropic_messages.request import parse_messages_request
from ninfer.server.errors import APIError
from ninfer.server.openai_chat.request import parse_chat_request
from ninfer.server.openai_responses.history import build_conversation
from ninfer.server.openai_responses.request import parse_create
from ninfer.server.reasoning_envelope import open_envelope, seal
from ninfer.server.request_context import RequestContext
from ninfer.server.validation.tools import check_template_renders_tools
from tests.server.capability_sets import CHATML, QWEN35
from tests.server.conftest import RunningServer, scripted_server

REASONING = "Check the weather tool first."
ANSWER = "It is sunny."
SCRIPT = f"{REASONING}</think>\n\n{ANSWER}"
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
FN = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}


@pytest.fixture(scope="module")
def server(tiny_qwen) -> Iterator[RunningServer]:
    """Every prompt is answered with reasoning, then text."""
    running = scripted_server(tiny_qwen, SCRIPT, default_max_tokens=64, max_concurrency=2)
    yield running
    running.stop()


def post(server: RunningServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def count_responses(server: RunningServer, body: dict) -> int:
    resp = post(server, "/v1/responses/input_tokens", {"model": server.serving.model_id, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["input_tokens"]


# ---- OpenAI Responses (Codex) ----------------------------------------------------------------


def test_encrypted_reasoning_is_the_sealed_text_and_round_trips(server):
    model = server.serving.model_id
    body = {"model": model, "input": "Weather?", "store": False, "include": ["reasoning.encrypted_content"]}
    resp = post(server, "/v1/responses", body)
    assert resp.status_code == 200, resp.text
    reasoning, message = resp.json()["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == REASONING
    assert open_envelope(reasoning["encrypted_content"]) == REASONING
    # Without the include the Item carries no encrypted_content.
    plain = post(server, "/v1/responses", {**body, "include": []}).json()["output"][0]
    assert "encrypted_content" not in plain

    # Replays as Codex sends them: the whole Item, content null, or only the envelope.
    history = [{"role": "user", "content": "Weather?"}]
    follow_up = {"role": "user", "content": "And tomorrow?"}
    counts = set()
    for replayed in (
        reasoning,
        {**reasoning, "content": None},
        {"type": "reasoning", "summary": [], "encrypted_content": reasoning["encrypted_content"]},
    ):
        counts.add(count_responses(server, {"input": [*history, replayed, message, follow_up], "preserve_thinking": True}))
    assert len(counts) == 1
    without_reasoning = count_responses(server, {"input": [*history, message, follow_up], "preserve_thinking": True})
    assert counts != {without_reasoning}  # the reasoning really is in the prompt (a preserved closed turn)
    # Another server's encrypted content cannot be replayed: the field is named.
    foreign = {"type": "reasoning", "summary": [], "content": None, "encrypted_content": "gAAAAABforeign"}
    resp = post(server, "/v1/responses/input_tokens", {"model": model, "input": [*history, foreign, message, follow_up]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input[1]"


def test_codex_replay_shapes_are_accepted(server):
    """Explicit nulls, item ids, statuses and output_text logprobs, as Codex replays its history."""
    model = server.serving.model_id
    items = [
        {"type": "message", "id": "msg_dev", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "id": "msg_u1", "role": "user", "content": [{"type": "input_text", "text": "Run it."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "ok"}],
         "encrypted_content": None},
        {"type": "function_call", "id": "fc_1", "status": "completed", "call_id": "call_1", "name": "lookup",
         "arguments": '{"q": "x"}'},
        {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "result"},
        {"type": "message", "id": "msg_a1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Done.", "annotations": [], "logprobs": []}]},
        {"type": "message", "id": "msg_u2", "role": "user", "content": [{"type": "input_text", "text": "Again."}]},
    ]
    body = {"model": model, "input": items, "tools": [FN, WEB_SEARCH], "store": False, "stream": False,
            "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"], "tool_choice": "auto",
            "parallel_tool_calls": True, "prompt_cache_key": "session-1", "client_metadata": {"turn": "1"}}
    resp = post(server, "/v1/responses", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "completed"


def test_hosted_tools_are_left_out_of_the_prompt(server):
    with_hosted = count_responses(server, {"input": "Hi", "tools": [FN, WEB_SEARCH]})
    assert with_hosted == count_responses(server, {"input": "Hi", "tools": [FN]})
    assert with_hosted > count_responses(server, {"input": "Hi"})
    resp = post(server, "/v1/responses", {"model": server.serving.model_id, "input": "Hi", "tools": [WEB_SEARCH]})
    assert resp.status_code == 200 and resp.json()["tools"] == [WEB_SEARCH]  # echoed as sent
    forced = {"model": server.serving.model_id, "input": "Hi", "tools": [WEB_SEARCH], "tool_choice": {"type": "web_search"}}
    resp = post(server, "/v1/responses", forced)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"


def test_verbosity_is_a_hint(server):
    model = server.serving.model_id
    low = post(server, "/v1/responses", {"model": model, "input": "Hi", "text": {"verbosity": "low"}})
    assert low.status_code == 200 and low.json()["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    assert count_responses(server, {"input": "Hi", "text": {"verbosity": "high"}}) == count_responses(
        server, {"input": "Hi"}
    )


# ---- Anthropic Messages (Claude Code) --------------------------------------------------------


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: ") :])))
    return events


def count_messages(server: RunningServer, body: dict) -> int:
    resp = post(server, "/v1/messages/count_tokens", {"model": "local", **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["input_tokens"]


def test_omitted_thinking_travels_in_the_signature(server):
    body = {"model": "claude-local", "max_tokens": 64, "messages": [{"role": "user", "content": "Weather?"}],
            "thinking": {"type": "adaptive", "display": "omitted"}}
    aggregate = post(server, "/v1/messages", body).json()
    thinking, text = aggregate["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == ""
    assert open_envelope(thinking["signature"]) == REASONING and text["text"] == ANSWER
    with httpx.stream("POST", server.base_url + "/v1/messages", json={**body, "stream": True}, timeout=60) as resp:
        events = sse_events(resp)
    deltas = [p["delta"]["type"] for n, p in events if n == "content_block_delta"]
    assert "thinking_delta" not in deltas and "signature_delta" in deltas
    # Replaying the block without its text renders what replaying it with the text renders.
    turn = [{"role": "user", "content": "Weather?"}]
    follow = {"role": "user", "content": "Tomorrow?"}
    visible = {"type": "thinking", "thinking": REASONING, "signature": seal(REASONING)}
    counts = {
        count_messages(server, {"messages": [*turn, {"role": "assistant", "content": [block, text]}, follow],
                                "preserve_thinking": True})
        for block in (thinking, visible)
    }
    assert len(counts) == 1


def test_effort_and_deferred_tools_as_claude_code_sends_them(server):
    tool = {"name": "Bash", "description": "Run a command",
            "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                             "properties": {"command": {"type": "string"}}, "additionalProperties": False}}
    deferred = {"name": "Later", "description": "Loaded on demand", "defer_loading": True,
                "input_schema": {"type": "object", "properties": {}}}
    body = {
        "model": "claude-local", "max_tokens": 64, "tools": [tool, deferred],
        "system": [{"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Go."},
            {"role": "system", "content": "Environment: test.", "output_config": {"effort": "medium"}},
        ],
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
    }
    resp = httpx.post(server.base_url + "/v1/messages?beta=true", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert count_messages(server, body) > count_messages(server, {**body, "tools": [tool]})  # rendered at once
    reference = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [{"type": "tool_reference", "tool_name": "Later"}]}]}
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "x"}}]}
    assert count_messages(server, {**body, "messages": [*body["messages"], call, reference]}) > 0


# ---- every protocol --------------------------------------------------------------------------


def test_capacity_refusals_carry_retry_after(tiny_qwen):
    server = scripted_server(tiny_qwen, SCRIPT, max_pending_requests=0, default_max_tokens=4)
    try:
        ticket = server.serving.engine.reserve()  # the only place: as if a request were in flight
        try:
            chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
            messages = post(server, "/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
        finally:
            ticket.release()
        assert (chat.status_code, chat.headers["retry-after"]) == (429, "1")
        assert (messages.status_code, messages.headers["retry-after"]) == (529, "1")
    finally:
        server.stop()


TOOL_BODIES = {
    "chat": {"messages": [{"role": "user", "content": "Hi"}],
             "tools": [{"type": "function", "function": {"name": "lookup"}}]},
    "responses": {"model": "m", "input": "Hi", "tools": [FN]},
    "messages": {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                 "tools": [{"name": "lookup", "input_schema": {"type": "object"}}]},
}
PARSERS = {"chat": parse_chat_request, "messages": parse_messages_request}


@pytest.mark.parametrize("protocol", sorted(TOOL_BODIES))
def test_tools_a_template_cannot_render_are_a_clear_400(protocol):
    context = RequestContext("m", CHATML)
    if protocol == "responses":
        # Responses builds its Conversation after the store lookup; the rule runs on that Conversation.
        conversation = build_conversation(parse_create(TOOL_BODIES[protocol], context), [], None)
        with pytest.raises(APIError) as err:
            check_template_renders_tools(conversation, CHATML, "tools")
    else:
        with pytest.raises(APIError) as err:
            PARSERS[protocol](TOOL_BODIES[protocol], context)
        PARSERS[protocol](TOOL_BODIES[protocol], RequestContext("m", QWEN35))  # a tool template renders them
    assert (err.value.status, err.value.code, err.value.param) == (400, "tools_not_supported", "tools")


def test_the_vision_switch_says_the_same_in_every_protocol():
    context = RequestContext("m", QWEN35)
    image = "data:image/png;base64,AAAA"
    bodies = [
        (parse_chat_request, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": image}]}]}),
        (parse_create, {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": image}]}]}),
        (parse_messages_request, {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}),
    ]
    messages = set()
    for parse, body in bodies:
        with pytest.raises(APIError) as err:
            parse(body, context)
        assert err.value.code == "vision_disabled"
        messages.add(err.value.message.split(": ", 1)[1])
    assert messages == {"this server does not accept image or video input (vision is not enabled)"}
