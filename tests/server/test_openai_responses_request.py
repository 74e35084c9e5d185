"""Responses request rules: every acceptance and rejection of the create table and the Input Item
contract over HTTP (status, code and field), plus the Item history -> prompt step on the real
Qwen3.5 template (result reordering, assistant turn grouping, cache-write slots, tool identities)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from ninfer.contract.reuse_path import ReusePath
from ninfer.server.openai_responses.history import build_conversation
from ninfer.server.openai_responses.request import parse_create
from tests.server.conftest import serve_config, start_server

FN = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
NS = {"type": "namespace", "name": "mcp__docs", "description": "Docs",
      "tools": [{"type": "function", "name": "lookup"}]}
CALL_A = {"type": "function_call", "call_id": "call_a", "name": "lookup", "arguments": '{"q": "a"}'}
CALL_B = {"type": "function_call", "call_id": "call_b", "name": "lookup", "namespace": "mcp__docs",
          "arguments": '{"q": "b"}'}
OUT_A = {"type": "function_call_output", "call_id": "call_a", "output": "A"}
OUT_B = {"type": "function_call_output", "call_id": "call_b", "output": "B"}
USER = {"role": "user", "content": "question"}
IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}


@pytest.fixture(scope="module")
def server(tiny_qwen) -> Iterator:
    running = start_server(serve_config(tiny_qwen, default_max_tokens=1))
    yield running
    running.stop()


def post(server, body: dict, path: str = "/v1/responses") -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def with_model(server, body: dict) -> dict:
    return {"model": server.serving.model_id, "input": "hi", **body}


# (overrides of a valid body, status, code, param); None removes the field.
REJECTIONS = [
    ({"model": None}, 400, "missing_required_parameter", "model"),
    ({"model": ""}, 400, "invalid_value", "model"),
    ({"model": 7}, 400, "invalid_type", "model"),
    ({"model": "gpt-5"}, 404, "model_not_found", "model"),
    ({"frobnicate": 1}, 400, "unknown_parameter", "frobnicate"),
    ({"enable_thinking": False}, 400, "unknown_parameter", "enable_thinking"),
    ({"input": None}, 400, "missing_required_parameter", "input"),
    ({"input": []}, 400, "missing_required_parameter", "input"),
    ({"input": 5}, 400, "invalid_type", "input"),
    ({"instructions": ["x"]}, 400, "invalid_type", "instructions"),
    ({"previous_response_id": "resp_missing"}, 404, "response_not_found", "previous_response_id"),
    ({"max_output_tokens": -1}, 400, "invalid_value", "max_output_tokens"),
    ({"max_output_tokens": "9"}, 400, "invalid_type", "max_output_tokens"),
    ({"stream": "yes"}, 400, "invalid_type", "stream"),
    ({"store": 1}, 400, "invalid_type", "store"),
    ({"temperature": 2.5}, 400, "invalid_value", "temperature"),
    ({"top_p": -0.1}, 400, "invalid_value", "top_p"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "invalid_value", "metadata"),
    ({"metadata": {"k" * 65: "v"}}, 400, "invalid_value", "metadata"),
    ({"metadata": {"k": "v" * 513}}, 400, "invalid_value", "metadata.k"),
    ({"metadata": {"k": 1}}, 400, "invalid_type", "metadata.k"),
    ({"client_metadata": "trace"}, 400, "invalid_type", "client_metadata"),
    ({"reasoning": {"effort": "low"}}, 400, "reasoning_effort_not_supported", "reasoning.effort"),
    ({"reasoning": {"effort": "xhigh"}}, 400, "reasoning_effort_not_supported", "reasoning.effort"),
    ({"reasoning": {"effort": "minimal"}}, 400, "reasoning_effort_not_supported", "reasoning.effort"),
    ({"reasoning": {"effort": "high"}}, 400, "reasoning_effort_not_supported", "reasoning.effort"),
    ({"reasoning": {"effort": "max"}}, 400, "reasoning_effort_not_supported", "reasoning.effort"),
    ({"reasoning": {"effort": "huge"}}, 400, "invalid_value", "reasoning.effort"),
    ({"reasoning": {"summary": "detailed"}}, 400, "unsupported_parameter", "reasoning.summary"),
    ({"reasoning": {"context": "all_turns"}}, 400, "unsupported_parameter", "reasoning.context"),
    ({"preserve_thinking": True, "chat_template_kwargs": {"preserve_thinking": False}}, 400,
     "conflicting_template_option", "preserve_thinking"),
    ({"preserve_thinking": "yes"}, 400, "invalid_type", "preserve_thinking"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, 400, "unsupported_parameter",
     "chat_template_kwargs.enable_thinking"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "missing_required_parameter",
     "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/nope"}}}}, 400, "invalid_schema",
     "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, 400, "invalid_value", "text.format.type"),
    ({"text": {"verbosity": "loud"}}, 400, "invalid_value", "text.verbosity"),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, 400, "unsupported_parameter",
     "tool_choice"),
    ({"tools": [{"type": "local_shell"}]}, 400, "unsupported_parameter", "tools[0].type"),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, 400, "unsupported_parameter", "tools[0].type"),
    ({"tools": [{"type": "custom", "name": "x"}]}, 400, "unsupported_parameter", "tools[0].type"),
    ({"tools": [{**FN, "strict": "yes"}]}, 400, "invalid_type", "tools[0].strict"),
    ({"tools": [{**FN, "strict": True, "parameters": {"type": "object", "properties": {"a<b": {}}}}]}, 400,
     "invalid_schema", "tools[0].parameters.properties"),
    ({"tools": [{**FN, "defer_loading": True}]}, 400, "unsupported_parameter", "tools[0].defer_loading"),
    ({"tools": [{**FN, "output_schema": {"type": "string"}}]}, 400, "unsupported_parameter",
     "tools[0].output_schema"),
    ({"tools": [{**FN, "allowed_callers": ["programmatic"]}]}, 400, "unsupported_parameter",
     "tools[0].allowed_callers"),
    ({"tools": [FN, FN]}, 400, "invalid_value", "tools[1].name"),
    ({"tools": [{**FN, "name": "mcp__docs__lookup"}, NS]}, 400, "invalid_value", "tools[1].tools[0].name"),
    ({"tools": [{**NS, "tools": []}]}, 400, "invalid_value", "tools[0].tools"),
    ({"tools": [{**NS, "tools": [{"type": "custom", "name": "x"}]}]}, 400, "unsupported_parameter",
     "tools[0].tools[0].type"),
    ({"tools": [{"type": "function"}]}, 400, "missing_required_parameter", "tools[0].name"),
    ({"tool_choice": "required"}, 400, "invalid_value", "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "function", "name": "other"}}, 400, "invalid_value", "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": []}}, 400,
     "invalid_value", "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                     "tools": [{"type": "function", "name": "missing"}]}}, 400, "invalid_value",
     "tool_choice.tools[0]"),
    ({"tools": [NS], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                     "tools": [{"type": "function", "name": "lookup"}]}}, 400, "invalid_value",
     "tool_choice.tools[0]"),
    ({"tools": [NS], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                     "tools": [{"type": "function", "name": "mcp__docs__lookup"}]}}, 400,
     "invalid_value", "tool_choice.tools[0]"),
    ({"tools": [FN], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                     "tools": [{"type": "mcp", "server_label": "x"}]}}, 400,
     "unsupported_parameter", "tool_choice.tools[0].type"),
    ({"tools": [FN], "tool_choice": "sometimes"}, 400, "invalid_value", "tool_choice"),
    ({"tools": [FN], "parallel_tool_calls": "no"}, 400, "invalid_type", "parallel_tool_calls"),
    ({"max_tool_calls": -1}, 400, "invalid_value", "max_tool_calls"),
    ({"truncation": "auto"}, 400, "unsupported_parameter", "truncation"),
    ({"truncation": "sometimes"}, 400, "invalid_value", "truncation"),
    ({"top_logprobs": 21}, 400, "invalid_value", "top_logprobs"),
    ({"service_tier": "flex"}, 400, "unsupported_parameter", "service_tier"),
    ({"service_tier": "gold"}, 400, "invalid_value", "service_tier"),
    ({"background": True}, 400, "unsupported_parameter", "background"),
    ({"include": ["message.input_image.image_url"]}, 400, "unsupported_parameter", "include"),
    ({"include": ["reasoning.encrypted_content", 5]}, 400, "invalid_type", "include[1]"),
    ({"stream_options": {"include_obfuscation": "no"}}, 400, "invalid_type", "stream_options.include_obfuscation"),
    ({"prompt_cache_retention": "1y"}, 400, "invalid_value", "prompt_cache_retention"),
    ({"prompt_cache_options": {"mode": "always"}}, 400, "invalid_value", "prompt_cache_options.mode"),
    ({"prompt_cache_key": 5}, 400, "invalid_type", "prompt_cache_key"),
    ({"safety_identifier": 5}, 400, "invalid_type", "safety_identifier"),
    ({"conversation": "conv_1"}, 400, "unsupported_parameter", "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, 400, "unsupported_parameter", "prompt"),
    ({"context_management": [{"type": "compaction"}]}, 400, "unsupported_parameter", "context_management"),
    # Input Items
    ({"input": [{"role": "user", "content": [IMAGE]}]}, 400, "vision_disabled", "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_video", "video_url": "https://x.test/v.mp4"}]}]}, 400,
     "vision_disabled", "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{**IMAGE, "detail": "high"}]}]}, 400, "unsupported_parameter",
     "input[0].content[0].detail"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}, 400,
     "unsupported_parameter", "input[0].content[0].file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]}, 400,
     "unsupported_parameter", "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, 400,
     "unsupported_parameter", "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]}, 400, "invalid_value",
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x",
                                              "prompt_cache_breakpoint": {"mode": "implicit"}}]}]}, 400,
     "invalid_value", "input[0].content[0].prompt_cache_breakpoint.mode"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "invalid_value", "input[0].role"),
    ({"input": [{"role": "user"}]}, 400, "missing_required_parameter", "input[0].content"),
    ({"input": [{"content": "no role or type"}]}, 400, "missing_required_parameter", "input[0].type"),
    ({"input": [USER, {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}]}, 400,
     "unsupported_parameter", "input[1]"),
    ({"input": [USER, {"type": "reasoning", "summary": [], "encrypted_content": "xyz"}]}, 400,
     "unsupported_parameter", "input[1]"),
    ({"input": [USER, {**CALL_A, "status": "in_progress"}]}, 400, "unsupported_parameter", "input[1].status"),
    ({"input": [USER, {**CALL_A, "caller": {"type": "program", "caller_id": "p"}}]}, 400, "unsupported_parameter",
     "input[1].caller"),
    ({"input": [USER, {**CALL_A, "arguments": "[1]"}]}, 400, "invalid_value", "input[1].arguments"),
    ({"input": [USER, {**CALL_A, "arguments": "{oops"}]}, 400, "invalid_value", "input[1].arguments"),
    ({"input": [USER, {**CALL_A, "call_id": None}]}, 400, "missing_required_parameter", "input[1].call_id"),
    ({"input": [USER, CALL_A, {**OUT_A, "output": []}]}, 400, "invalid_value", "input[2].output"),
    ({"input": [USER, CALL_A, {**OUT_A, "output": [{"type": "input_file", "file_id": "f"}]}]}, 400,
     "unsupported_parameter", "input[2].output[0]"),
    ({"input": [USER, CALL_A, {**OUT_A, "status": "incomplete"}]}, 400, "unsupported_parameter",
     "input[2].status"),
    ({"input": [USER, CALL_A, {**OUT_A, "call_id": "call_x"}]}, 400, "invalid_tool_history", "input[2].call_id"),
    ({"input": [USER, CALL_A, OUT_A, OUT_A]}, 400, "invalid_tool_history", "input[3].call_id"),
    ({"input": [USER, CALL_A, CALL_B, OUT_B]}, 400, "invalid_tool_history", "input[3]"),
    ({"input": [USER, CALL_A, {**OUT_A, "name": "other"}]}, 400, "invalid_tool_history", "input[2]"),
    ({"input": [USER, CALL_A, USER, OUT_A]}, 400, "invalid_tool_history", "input[3].call_id"),
    ({"input": [OUT_A]}, 400, "invalid_tool_history", "input[0].call_id"),
    ({"input": [USER, {**CALL_A, "call_id": "call_b"}, CALL_B]}, 400, "invalid_tool_history", "input[2].call_id"),
    ({"input": [USER, CALL_A, {"role": "assistant", "content": "late text"}]}, 400, "invalid_assistant_history",
     "input[2]"),
    ({"input": [USER, {"role": "assistant", "content": "text"},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]}]}, 400,
     "invalid_assistant_history", "input[2]"),
    ({"input": [{**USER, "id": "msg_1"}, {**USER, "id": "msg_1"}]}, 400, "duplicate_item_id", "input[1].id"),
    ({"input": [USER, {"type": "item_reference", "id": "msg_0"}]}, 400, "unsupported_parameter", "input[1].type"),
    ({"input": [USER, {"type": "web_search_call", "id": "ws_1"}]}, 400, "unsupported_parameter", "input[1].type"),
    ({"input": [USER, {"type": "custom_tool_call", "call_id": "c", "name": "x", "input": ""}]}, 400,
     "unsupported_parameter", "input[1].type"),
]


@pytest.mark.parametrize(("overrides", "status", "code", "param"), REJECTIONS,
                         ids=[f"{i}-{r[2]}-{r[3]}" for i, r in enumerate(REJECTIONS)])
def test_rejections_name_the_field(server, overrides, status, code, param):
    body = with_model(server, overrides)
    body = {key: value for key, value in body.items() if value is not None}
    resp = post(server, body)
    error = resp.json()["error"]
    assert (resp.status_code, error["code"], error["param"]) == (status, code, param), error["message"]
    assert resp.headers["x-request-id"]


ACCEPTED = [
    {"instructions": "Be brief.", "max_output_tokens": 0, "temperature": 0, "top_p": 1},
    {"metadata": {f"k{i}": "v" * 512 for i in range(16)}, "client_metadata": None},
    {"client_metadata": {"codex": {"turn": 1}}, "safety_identifier": "u1", "user": "u1", "prompt_cache_key": "k"},
    {"reasoning": {"effort": "none", "summary": "auto"}, "preserve_thinking": True,
     "chat_template_kwargs": {"preserve_thinking": True}},
    {"reasoning": {"effort": None, "context": "auto", "mode": "standard"}},
    {"text": {"format": {"type": "text"}, "verbosity": "medium"}, "truncation": "disabled", "top_logprobs": 0},
    {"service_tier": "default", "background": False, "include": [], "max_tool_calls": 0, "store": False},
    {"parallel_tool_calls": False, "tools": [FN], "tool_choice": "none"},
    {"parallel_tool_calls": False, "tools": []},
    {"tools": [FN, NS], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                        "tools": [{"type": "function", "name": "lookup", "namespace": "mcp__docs"}]}},
    {"tools": [{**FN, "strict": False, "allowed_callers": ["direct"]}]},
    {"prompt_cache_options": {"mode": "explicit", "ttl": "12h"}, "prompt_cache_retention": "24h"},
    {"stream_options": {"include_obfuscation": True}, "conversation": None, "prompt": None},
    # Items: typed content, replayed assistant turns, results out of order, partial leading results.
    {"input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
               {"role": "system", "content": "s", "status": "completed"},
               {"role": "user", "content": [{"type": "input_text", "text": "a",
                                             "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "30m"}}]}]},
    {"input": [USER, {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s"}],
                      "content": [{"type": "reasoning_text", "text": "r"}], "encrypted_content": "opaque"},
               {"type": "message", "role": "assistant", "id": "msg_a", "status": "incomplete", "phase": "commentary",
                "content": [{"type": "output_text", "text": "t", "annotations": []},
                            {"type": "refusal", "refusal": "no"}]},
               CALL_A, {**CALL_B, "id": "fc_b"}, OUT_B, {**OUT_A, "name": "lookup"}, USER]},
    {"input": [USER, CALL_A, CALL_B, OUT_A, USER]},
    {"input": [USER, CALL_A, {"role": "developer", "content": "note"}, OUT_A]},
    {"input": [USER, {"role": "assistant", "content": "first"}, {"role": "assistant", "content": "second"}]},
    {"input": [USER, CALL_A, {**OUT_A, "output": [{"type": "input_text", "text": "x"}]}]},
]


@pytest.mark.parametrize("overrides", ACCEPTED, ids=[str(i) for i in range(len(ACCEPTED))])
def test_accepted_shapes(server, overrides):
    resp = post(server, with_model(server, {"max_output_tokens": 1, **overrides}))
    assert resp.status_code == 200, resp.json()
    assert resp.json()["status"] in ("completed", "incomplete")


def test_input_tokens_accepts_only_prompt_fields(server):
    base = {"model": server.serving.model_id, "input": "hi"}
    ok = post(server, {**base, "tools": [FN], "tool_choice": "auto", "parallel_tool_calls": True,
                       "reasoning": {"effort": "none"}, "text": {"format": {"type": "text"}},
                       "truncation": "disabled", "preserve_thinking": False}, "/v1/responses/input_tokens")
    assert ok.status_code == 200 and ok.json()["object"] == "response.input_tokens"
    no_model = post(server, {"input": "hi"}, "/v1/responses/input_tokens")
    assert no_model.json()["input_tokens"] == post(server, base, "/v1/responses/input_tokens").json()["input_tokens"]
    for extra, code in (({"max_output_tokens": 5}, "unknown_parameter"), ({"store": True}, "unknown_parameter"),
                        ({"conversation": "c"}, "unsupported_parameter"),
                        ({"personality": "friendly"}, "unsupported_parameter"),
                        ({"model": "other"}, "model_not_found"),
                        ({"input": [{"role": "user", "content": [IMAGE]}]}, "vision_disabled")):
        resp = post(server, {**base, **extra}, "/v1/responses/input_tokens")
        assert resp.json()["error"]["code"] == code, extra


def test_validation_happens_before_any_stream(server):
    resp = post(server, with_model(server, {"stream": True, "temperature": 9}))
    assert resp.status_code == 400 and resp.headers["content-type"].startswith("application/json")


# ---- Item history -> prompt ------------------------------------------------------------------


def prompt_of(server, body: dict, history: list[dict] | None = None):
    context = server.serving.request_context
    request = parse_create({"model": server.serving.model_id, **body}, context)
    conversation = build_conversation(request, history or [], None)
    return conversation, server.serving.prompt_builder.build(conversation)


def test_results_render_in_call_order(server):
    tools = {"tools": [FN, NS]}
    _, ordered = prompt_of(server, {"input": [USER, CALL_A, CALL_B, OUT_A, OUT_B], **tools})
    conversation, reversed_ = prompt_of(server, {"input": [USER, CALL_A, CALL_B, OUT_B, OUT_A], **tools})
    assert reversed_.token_ids == ordered.token_ids
    assert [m.tool_call_id for m in conversation.messages if m.role == "tool"] == ["call_a", "call_b"]
    text = server.serving.artifact.tokenizer.decode(ordered.token_ids)
    # Namespaced functions get their own identity in the prompt; direct ones keep their name.
    assert '"name": "mcp__docs__lookup"' in text and "<function=mcp__docs__lookup>" in text
    assert "<function=lookup>" in text


def test_assistant_items_form_one_turn(server):
    reasoning = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "why"}]}
    items = [USER, reasoning, {"role": "assistant", "content": "one "}, {"role": "assistant", "content": "two"},
             CALL_A, OUT_A]
    conversation, _ = prompt_of(server, {"input": items, "tools": [FN]})
    roles = [m.role for m in conversation.messages]
    assert roles == ["user", "assistant", "tool"]
    turn = conversation.messages[1]
    assert turn.reasoning == "why" and turn.text == "one two" and [c.call_id for c in turn.tool_calls] == ["call_a"]
    assert list(turn.tool_calls[0].arguments) == ["q"]


def test_instructions_lead_and_system_items_keep_their_place(server):
    items = [USER, {"role": "assistant", "content": "ok"}, {"role": "developer", "content": "mid"}, USER]
    conversation, prepared = prompt_of(server, {"input": items, "instructions": "lead"})
    assert [m.role for m in conversation.messages] == ["developer", "user", "assistant", "developer", "user"]
    text = server.serving.artifact.tokenizer.decode(prepared.token_ids)
    assert text.startswith("<|im_start|>system\nlead<|im_end|>")
    assert text.index("<|im_start|>system\nmid") > text.index("<|im_start|>assistant")


def marked(text: str) -> dict:
    return {"type": "input_text", "text": text, "prompt_cache_breakpoint": {"mode": "explicit"}}


def shared_frontiers(prepared) -> list[int]:
    return [hint.frontier for hint in prepared.capture_hints if hint.path is ReusePath.SHARED_STABLE_PREFIX]


def test_at_most_four_cache_writes(server):
    # Six explicit markers on separate turns, the last one also the implicit target.
    items = []
    for i in range(6):
        items += [{"role": "user", "content": [marked(f"part {i}")]}, {"role": "assistant", "content": f"ok {i}"}]
    items = items[:-1]
    conversation, prepared = prompt_of(server, {"input": items})
    flags = [p.cache_breakpoint for m in conversation.messages for p in m.content]
    assert flags.count(True) == 4 and [i for i, f in enumerate(flags) if f] == [4, 6, 8, 10]  # the latest four
    assert len(shared_frontiers(prepared)) == 4

    # The implicit target on plain text takes one slot, leaving three for the latest explicit markers.
    conversation, prepared = prompt_of(server, {"input": [*items, {"role": "assistant", "content": "x"}, USER]})
    assert [p.cache_breakpoint for m in conversation.messages for p in m.content].count(True) == 3
    assert len(shared_frontiers(prepared)) == 4
    # Explicit mode drops the implicit write; history from a stored chain writes nothing new.
    _, prepared = prompt_of(server, {"input": [USER], "prompt_cache_options": {"mode": "explicit"}})
    assert shared_frontiers(prepared) == []
    request_items = parse_create({"model": server.serving.model_id, "input": items},
                                 server.serving.request_context).items
    conversation, _ = prompt_of(server, {"input": [USER], "previous_response_id": "resp_x"}, history=request_items)
    assert not any(p.cache_breakpoint for m in conversation.messages for p in m.content)
