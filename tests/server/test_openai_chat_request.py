"""parse_chat_request: every acceptance, neutral-value and rejection rule of the Chat Completions spec.

Pure-Python: bodies are plain dicts (member order as received), capabilities are built directly
for three template shapes (Qwen3.5-like switch, Qwen3.8-like effort tiers, plain ChatML).
"""

from __future__ import annotations

import copy
from typing import Any
from unittest.mock import ANY

import pytest

from ninfer.contract.sampling import SamplingOverrides
from ninfer.frontend.capabilities import TemplateCapabilities
from ninfer.frontend.conversation import MediaPart, TextPart, ToolCall
from ninfer.server.errors import APIError
from ninfer.server.openai_chat.request import ChatRequest, parse_chat_request
from ninfer.server.request_context import RequestContext

MODEL = "qwen3.8-27b"

from tests.server.capability_sets import CHATML, QWEN35, QWEN38

# A template that always opens a think block and has no switch (e.g. an R1-style template).
ALWAYS_THINKS = TemplateCapabilities(
    supports_thinking_switch=False,
    thinking_default=True,
    effort_tiers=(),
    default_effort=None,
    supports_preserve_thinking=False,
    preserve_thinking_default=False,
    think_open="<think>",
    think_close="</think>",
)
CAPS = {"qwen3.5": QWEN35, "qwen3.8": QWEN38, "chatml": CHATML}

USER = {"role": "user", "content": "Hi"}


def body(**fields: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL, "messages": [USER]}
    out.update(fields)
    return out


def parse(payload: Any, caps: TemplateCapabilities = QWEN35, vision: bool = False) -> ChatRequest:
    return parse_chat_request(payload, RequestContext(model_id=MODEL, capabilities=caps, vision_enabled=vision))


def rejected(
    payload: Any, *, param: str | None, code: str, status: int = 400, caps=QWEN35, vision: bool = False
) -> APIError:
    with pytest.raises(APIError) as caught:
        parse(payload, caps, vision)
    error = caught.value
    assert (error.status, error.code, error.param) == (status, code, param), error.message
    return error


def unsupported(payload: Any, param: str, guarantee: str, **kwargs) -> None:
    error = rejected(payload, param=param, code="unsupported_parameter", **kwargs)
    assert error.message.startswith(f"{param}: NInfer cannot provide ")
    assert guarantee in error.message


def tool(name: str, parameters: dict | None = None, **extra: Any) -> dict:
    function: dict[str, Any] = {"name": name, **extra}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---- body, model, defaults ---------------------------------------------------------------------


def test_minimal_request_defaults():
    request = parse(body())
    assert request.stream is False and request.include_usage is False
    assert request.max_tokens is None
    assert request.sampling == SamplingOverrides()
    assert request.stop == []
    assert request.tools_enabled is False and request.callable_tools == {}
    assert request.timings_per_token is False and request.return_progress is False
    assert request.requested_reasoning_effort is None
    assert request.prompt_cache_implicit is True
    conversation = request.conversation
    assert [(m.role, m.text) for m in conversation.messages] == [("user", "Hi")]
    assert conversation.tools == []
    assert (conversation.enable_thinking, conversation.reasoning_effort, conversation.preserve_thinking) == (
        None,
        None,
        None,
    )


@pytest.mark.parametrize("payload", [[], "text", None, 3, True])
def test_non_object_body_is_rejected(payload):
    rejected(payload, param=None, code="invalid_type")


def test_unknown_top_level_fields_are_ignored():
    request = parse(body(some_future_field={"x": 1}, another=[1, 2], chat_id="abc"))
    assert request.conversation.messages[0].text == "Hi"


@pytest.mark.parametrize("model", ["__omitted__", None, "", 5, [], {"id": MODEL}, MODEL])
def test_model_falls_back_to_loaded_model_unless_an_explicit_name(model):
    payload = body()
    if model == "__omitted__":
        del payload["model"]
    else:
        payload["model"] = model
    assert parse(payload).conversation.messages[0].text == "Hi"


def test_explicit_other_model_is_not_found():
    error = rejected(body(model="gpt-4o"), param="model", code="model_not_found", status=404)
    assert error.type == "not_found_error"
    assert "gpt-4o" in error.message


# ---- messages ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages, param, code",
    [
        ("__omitted__", "messages", "missing_required_parameter"),
        (None, "messages", "missing_required_parameter"),
        ("Hi", "messages", "invalid_type"),
        ({"role": "user"}, "messages", "invalid_type"),
        ([], "messages", "invalid_value"),
        ([USER, "Hi"], "messages[1]", "invalid_type"),
        ([{"content": "Hi"}], "messages[0].role", "missing_required_parameter"),
        ([{"role": 1, "content": "Hi"}], "messages[0].role", "invalid_type"),
        ([{"role": "narrator", "content": "Hi"}], "messages[0].role", "invalid_value"),
        ([{"role": "user"}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "system", "content": None}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "user", "content": 7}], "messages[0].content", "invalid_type"),
        ([{"role": "user", "content": {"type": "text", "text": "x"}}], "messages[0].content", "invalid_type"),
    ],
)
def test_malformed_messages(messages, param, code):
    payload = body()
    if messages == "__omitted__":
        del payload["messages"]
    else:
        payload["messages"] = messages
    rejected(payload, param=param, code=code)


def test_roles_keep_their_order_and_mapping():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "developer", "content": "D"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "f", "{}")]},
        {"role": "tool", "tool_call_id": "c1", "content": "R"},
        {"role": "system", "content": "S2"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "U2"},
    ]
    conversation = parse(body(messages=messages)).conversation
    assert [(m.role, m.text) for m in conversation.messages] == [
        ("system", "S"),
        ("user", "U1"),
        ("developer", "D"),
        ("assistant", ""),
        ("tool", "R"),
        ("system", "S2"),
        ("assistant", "A"),
        ("user", "U2"),
    ]
    assert conversation.messages[4].tool_call_id == "c1"


def test_string_content_is_kept_byte_for_byte():
    text = "  leading space,\r\n\ttabs and a trailing newline\n"
    messages = [{"role": "system", "content": text}, {"role": "user", "content": text}]
    assert [m.content for m in parse(body(messages=messages)).conversation.messages] == [[TextPart(text)]] * 2


def test_adjacent_text_parts_stay_separate_and_join_without_separator():
    content = [{"type": "text", "text": "Hello"}, {"type": "text", "text": ""}, {"type": "text", "text": " world"}]
    message = parse(body(messages=[{"role": "user", "content": content}])).conversation.messages[0]
    assert message.content == [TextPart("Hello"), TextPart(""), TextPart(" world")]
    assert message.text == "Hello world"


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant"])
@pytest.mark.parametrize("content", ["", []])
def test_empty_wire_content_is_an_empty_turn(role, content):
    messages = (
        [USER, {"role": role, "content": content}] if role == "assistant" else [{"role": role, "content": content}]
    )
    message = parse(body(messages=messages)).conversation.messages[-1]
    assert message.role == role and message.text == "" and not message.has_media


def test_assistant_null_content_is_an_empty_turn():
    message = parse(body(messages=[USER, {"role": "assistant", "content": None}])).conversation.messages[1]
    assert message.content == [] and message.tool_calls == []


def test_refusal_parts_and_field_enter_assistant_content():
    messages = [
        USER,
        {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "refusal", "refusal": "no."}]},
        USER,
        {"role": "assistant", "content": None, "refusal": "I can't help with that."},
        USER,
        {"role": "assistant", "content": "fine", "refusal": None},
    ]
    conversation = parse(body(messages=messages)).conversation
    assert conversation.messages[1].content == [TextPart("A"), TextPart("no.")]
    assert conversation.messages[3].text == "I can't help with that."
    assert conversation.messages[5].text == "fine"


@pytest.mark.parametrize(
    "message, param, code",
    [
        (
            {"role": "user", "content": [{"type": "refusal", "refusal": "x"}]},
            "messages[0].content[0].type",
            "invalid_value",
        ),
        ({"role": "user", "content": [{"type": "hologram"}]}, "messages[0].content[0].type", "invalid_value"),
        ({"role": "user", "content": [{"text": "x"}]}, "messages[0].content[0].type", "missing_required_parameter"),
        ({"role": "user", "content": ["x"]}, "messages[0].content[0]", "invalid_type"),
        ({"role": "user", "content": [{"type": "text", "text": 3}]}, "messages[0].content[0].text", "invalid_type"),
        ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0].text", "missing_required_parameter"),
        ({"role": "user", "content": "x", "reasoning_content": "r"}, "messages[0].reasoning_content", "invalid_value"),
        (
            {"role": "user", "content": "x", "tool_calls": [call("c", "f", "{}")]},
            "messages[0].tool_calls",
            "invalid_value",
        ),
        ({"role": "system", "content": "x", "refusal": "no"}, "messages[0].refusal", "invalid_value"),
    ],
)
def test_malformed_parts_and_role_misplaced_fields(message, param, code):
    rejected(body(messages=[message]), param=param, code=code)


def test_non_assistant_roles_accept_null_assistant_fields():
    message = {"role": "user", "content": "x", "tool_calls": [], "refusal": None, "reasoning_content": None}
    assert parse(body(messages=[message])).conversation.messages[0].text == "x"


def test_prompt_cache_breakpoint_marks_a_part():
    content = [
        {"type": "text", "text": "long system prefix", "prompt_cache_breakpoint": {"mode": "explicit"}},
        {"type": "text", "text": "tail", "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}},
        {"type": "text", "text": "plain"},
    ]
    message = parse(body(messages=[{"role": "system", "content": content}])).conversation.messages[0]
    assert [p.cache_breakpoint for p in message.content] == [True, True, False]


@pytest.mark.parametrize(
    "marker, param, code",
    [
        ({"mode": "implicit"}, "messages[0].content[0].prompt_cache_breakpoint.mode", "invalid_value"),
        ({"mode": "explicit", "ttl": "5d"}, "messages[0].content[0].prompt_cache_breakpoint.ttl", "invalid_value"),
        (True, "messages[0].content[0].prompt_cache_breakpoint", "invalid_type"),
    ],
)
def test_malformed_prompt_cache_breakpoint(marker, param, code):
    content = [{"type": "text", "text": "x", "prompt_cache_breakpoint": marker}]
    rejected(body(messages=[{"role": "user", "content": content}]), param=param, code=code)


# ---- media -------------------------------------------------------------------------------------

IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


def test_media_needs_vision():
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, IMAGE]}]
    error = rejected(body(messages=messages), param="messages[0].content[1]", code="vision_disabled")
    assert error.message == "messages[0].content[1]: this server does not accept image or video input (vision is not enabled)"


def test_media_parts_when_vision_is_on():
    content = [
        {"type": "text", "text": "compare "},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "auto"}},
        {"type": "image_url", "image_url": "data:image/png;base64,iVBORw0KGgo="},
        {"type": "video_url", "video_url": {"url": "HTTP://example.com/clip.mp4"}},
        {"type": "video_url", "video_url": "https://example.com/clip2.mp4"},
        {
            "type": "image_url",
            "image_url": {"url": "https://example.com/b.png"},
            "prompt_cache_breakpoint": {"mode": "explicit"},
        },
    ]
    tool_result = {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "shot:"}, IMAGE]}
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "screenshot", "{}")]},
        tool_result,
    ]
    conversation = parse(body(messages=messages), vision=True).conversation
    parts = conversation.messages[0].content
    assert parts[0] == TextPart("compare ")
    assert parts[1:] == [
        MediaPart("image", "https://example.com/a.png"),
        MediaPart("image", "data:image/png;base64,iVBORw0KGgo="),
        MediaPart("video", "HTTP://example.com/clip.mp4"),
        MediaPart("video", "https://example.com/clip2.mp4"),
        MediaPart("image", "https://example.com/b.png", cache_breakpoint=True),
    ]
    assert conversation.messages[2].content == [TextPart("shot:"), MediaPart("image", "https://example.com/cat.png")]


@pytest.mark.parametrize("detail", ["low", "high", "original"])
def test_explicit_image_detail_is_unsupported(detail):
    part = {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": detail}}
    unsupported(
        body(messages=[{"role": "user", "content": [part]}]),
        "messages[0].content[0].image_url.detail",
        "image detail",
        vision=True,
    )


@pytest.mark.parametrize(
    "part, param, code",
    [
        (
            {"type": "image_url", "image_url": {"url": "https://x", "detail": "ultra"}},
            "messages[0].content[0].image_url.detail",
            "invalid_value",
        ),
        (
            {"type": "image_url", "image_url": {"url": "ftp://x/y.png"}},
            "messages[0].content[0].image_url.url",
            "invalid_media",
        ),
        ({"type": "image_url", "image_url": "/etc/passwd"}, "messages[0].content[0].image_url", "invalid_media"),
        ({"type": "image_url", "image_url": {}}, "messages[0].content[0].image_url.url", "missing_required_parameter"),
        ({"type": "image_url", "image_url": 5}, "messages[0].content[0].image_url", "invalid_type"),
        ({"type": "video_url"}, "messages[0].content[0].video_url", "invalid_type"),
    ],
)
def test_malformed_media_parts(part, param, code):
    rejected(body(messages=[{"role": "user", "content": [part]}]), param=param, code=code, vision=True)


@pytest.mark.parametrize("role", ["system", "developer", "assistant"])
def test_media_only_in_user_and_tool_messages(role):
    messages = [USER, {"role": role, "content": [IMAGE]}]
    rejected(body(messages=messages), param="messages[1].content[0].type", code="invalid_value", vision=True)


@pytest.mark.parametrize(
    "part, guarantee",
    [
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio input"),
        ({"type": "file", "file": {"file_id": "file-1"}}, "file input"),
    ],
)
@pytest.mark.parametrize("vision", [False, True])
def test_audio_and_file_input_are_unsupported(part, guarantee, vision):
    unsupported(
        body(messages=[{"role": "user", "content": [part]}]), "messages[0].content[0]", guarantee, vision=vision
    )


# ---- names -------------------------------------------------------------------------------------


def test_tool_message_name_is_accepted_and_ignored():
    messages = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_time", "{}")]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_time", "content": "noon"},
    ]
    result = parse(body(messages=messages)).conversation.messages[2]
    assert (result.role, result.tool_call_id, result.text) == ("tool", "c1", "noon")


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
@pytest.mark.parametrize("name", [5, ["x"], {"n": 1}, True])
def test_non_string_name_is_malformed(role, name):
    message = {"role": role, "content": "x", "name": name}
    if role == "tool":
        message["tool_call_id"] = "c1"
    rejected(body(messages=[USER, message]), param="messages[1].name", code="invalid_type")


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant"])
def test_participant_names_are_unsupported(role):
    unsupported(
        body(messages=[USER, {"role": role, "content": "x", "name": "alice"}]), "messages[1].name", "participant"
    )


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant"])
@pytest.mark.parametrize("name", ["", None])
def test_empty_participant_name_is_neutral(role, name):
    assert (
        parse(body(messages=[USER, {"role": role, "content": "x", "name": name}])).conversation.messages[1].text == "x"
    )


# ---- assistant tool calls and reasoning --------------------------------------------------------


def test_tool_calls_keep_argument_member_order_and_ids():
    arguments = '{"zeta": 1, "alpha": {"y": [1, 2], "b": null}, "mid": "x"}'
    messages = [
        USER,
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [call("call_a", "lookup", arguments), call("call_b", "other", "{}")],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "1"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "2"}]},
    ]
    conversation = parse(body(messages=messages)).conversation
    assistant = conversation.messages[1]
    assert assistant.text == "Let me check."
    assert assistant.tool_calls == [
        ToolCall("lookup", {"zeta": 1, "alpha": {"y": [1, 2], "b": None}, "mid": "x"}, "call_a"),
        ToolCall("other", {}, "call_b"),
    ]
    assert list(assistant.tool_calls[0].arguments) == ["zeta", "alpha", "mid"]
    assert list(assistant.tool_calls[0].arguments["alpha"]) == ["y", "b"]
    assert [m.tool_call_id for m in conversation.messages[2:]] == ["call_a", "call_b"]


def test_tool_call_without_type_or_id_is_accepted():
    raw = {"function": {"name": "f", "arguments": '{"a": 1}'}}
    assistant = parse(body(messages=[USER, {"role": "assistant", "tool_calls": [raw]}])).conversation.messages[1]
    assert assistant.tool_calls == [ToolCall("f", {"a": 1}, None)]


@pytest.mark.parametrize(
    "raw_call, param, code",
    [
        (call("c", "f", "{not json"), "messages[1].tool_calls[0].function.arguments", "invalid_value"),
        (call("c", "f", "[1, 2]"), "messages[1].tool_calls[0].function.arguments", "invalid_value"),
        (call("c", "f", '"text"'), "messages[1].tool_calls[0].function.arguments", "invalid_value"),
        (call("c", "f", ""), "messages[1].tool_calls[0].function.arguments", "invalid_value"),
        (call("c", "f", '{"x": NaN}'), "messages[1].tool_calls[0].function.arguments", "invalid_value"),
        (
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
            "messages[1].tool_calls[0].function.arguments",
            "invalid_type",
        ),
        (
            {"id": "c", "type": "function", "function": {"name": "f"}},
            "messages[1].tool_calls[0].function.arguments",
            "missing_required_parameter",
        ),
        (call("c", "", "{}"), "messages[1].tool_calls[0].function.name", "invalid_value"),
        ({"id": "c", "type": "function"}, "messages[1].tool_calls[0].function", "invalid_type"),
        (
            {"id": 3, "type": "function", "function": {"name": "f", "arguments": "{}"}},
            "messages[1].tool_calls[0].id",
            "invalid_type",
        ),
        (
            {"id": "c", "type": "web", "function": {"name": "f", "arguments": "{}"}},
            "messages[1].tool_calls[0].type",
            "invalid_value",
        ),
        ("call", "messages[1].tool_calls[0]", "invalid_type"),
    ],
)
def test_malformed_tool_calls(raw_call, param, code):
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [raw_call]}]
    rejected(body(messages=messages), param=param, code=code)


def test_tool_calls_must_be_an_array():
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": {"id": "c"}}]
    rejected(body(messages=messages), param="messages[1].tool_calls", code="invalid_type")


def test_custom_tool_call_history_is_unsupported():
    raw = {"id": "c", "type": "custom", "custom": {"name": "f", "input": "x"}}
    unsupported(
        body(messages=[USER, {"role": "assistant", "tool_calls": [raw]}]), "messages[1].tool_calls[0].type", "custom"
    )


def test_assistant_audio_history_is_unsupported():
    message = {"role": "assistant", "content": "x", "audio": {"id": "audio_1"}}
    unsupported(body(messages=[USER, message]), "messages[1].audio", "audio")


@pytest.mark.parametrize(
    "fields, reasoning",
    [
        ({"reasoning_content": "think A"}, "think A"),
        ({"reasoning": "think B"}, "think B"),
        ({"reasoning_content": "same", "reasoning": "same"}, "same"),
        ({"reasoning_content": None, "reasoning": "alias"}, "alias"),
        ({"reasoning_content": ""}, ""),
        ({}, None),
    ],
)
def test_reasoning_aliases(fields, reasoning):
    message = {"role": "assistant", "content": "answer", **fields}
    assert parse(body(messages=[USER, message])).conversation.messages[1].reasoning == reasoning


def test_reasoning_aliases_must_agree():
    message = {"role": "assistant", "content": "a", "reasoning_content": "one", "reasoning": "two"}
    rejected(body(messages=[USER, message]), param="messages[1].reasoning", code="invalid_value")


@pytest.mark.parametrize("alias", ["reasoning_content", "reasoning"])
def test_reasoning_must_be_a_string(alias):
    message = {"role": "assistant", "content": "a", alias: {"text": "x"}}
    rejected(body(messages=[USER, message]), param=f"messages[1].{alias}", code="invalid_type")


@pytest.mark.parametrize(
    "message, param, code",
    [
        ({"role": "tool", "content": "r"}, "messages[1].tool_call_id", "missing_required_parameter"),
        ({"role": "tool", "content": "r", "tool_call_id": 4}, "messages[1].tool_call_id", "invalid_type"),
        ({"role": "tool", "content": "r", "tool_call_id": ""}, "messages[1].tool_call_id", "invalid_value"),
        ({"role": "tool", "tool_call_id": "c"}, "messages[1].content", "missing_required_parameter"),
        (
            {"role": "tool", "tool_call_id": "c", "content": [{"type": "refusal", "refusal": "x"}]},
            "messages[1].content[0].type",
            "invalid_value",
        ),
    ],
)
def test_malformed_tool_messages(message, param, code):
    rejected(body(messages=[USER, message]), param=param, code=code)


# ---- legacy function history -------------------------------------------------------------------


def test_legacy_function_history_pairs_call_and_result():
    messages = [
        USER,
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "weather", "arguments": '{"city": "Oslo", "unit": "C"}'},
        },
        {"role": "function", "name": "weather", "content": "3 degrees"},
        {"role": "assistant", "content": "It is 3 degrees."},
        USER,
        {"role": "assistant", "content": None, "function_call": {"name": "time", "arguments": "{}"}},
        {"role": "function", "name": "time", "content": None},
    ]
    conversation = parse(body(messages=messages)).conversation
    first_call = conversation.messages[1].tool_calls[0]
    assert (first_call.name, first_call.arguments) == ("weather", {"city": "Oslo", "unit": "C"})
    assert list(first_call.arguments) == ["city", "unit"]
    result = conversation.messages[2]
    assert (result.role, result.text, result.tool_call_id) == ("tool", "3 degrees", first_call.call_id)
    second_call = conversation.messages[5].tool_calls[0]
    assert conversation.messages[6].tool_call_id == second_call.call_id
    assert conversation.messages[6].text == ""
    assert first_call.call_id != second_call.call_id
    # Stable: the same history parses to the same ids (so replays render identically).
    again = parse(body(messages=copy.deepcopy(messages))).conversation
    assert [m.tool_call_id for m in again.messages] == [m.tool_call_id for m in conversation.messages]


@pytest.mark.parametrize(
    "messages, param",
    [
        ([USER, {"role": "function", "name": "f", "content": "r"}], "messages[1]"),
        (
            [
                USER,
                {"role": "assistant", "content": None, "tool_calls": [call("c", "f", "{}")]},
                {"role": "function", "name": "f", "content": "r"},
            ],
            "messages[2]",
        ),
        (
            [
                USER,
                {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
                {"role": "function", "name": "g", "content": "r"},
            ],
            "messages[2].name",
        ),
        (
            [
                USER,
                {
                    "role": "assistant",
                    "function_call": {"name": "f", "arguments": "{}"},
                    "tool_calls": [call("c", "g", "{}")],
                },
            ],
            "messages[1].function_call",
        ),
        (
            [USER, {"role": "assistant", "function_call": {"name": "f", "arguments": "1"}}],
            "messages[1].function_call.arguments",
        ),
    ],
)
def test_malformed_legacy_function_history(messages, param):
    rejected(body(messages=messages), param=param, code="invalid_value")


@pytest.mark.parametrize(
    "message, param, code",
    [
        ({"role": "function", "content": "r"}, "messages[2].name", "missing_required_parameter"),
        (
            {"role": "function", "name": "f", "content": [{"type": "text", "text": "r"}]},
            "messages[2].content",
            "invalid_type",
        ),
    ],
)
def test_malformed_function_messages(message, param, code):
    messages = [USER, {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}, message]
    rejected(body(messages=messages), param=param, code=code)


# ---- output budget, sampling, stop -------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({}, None),
        ({"max_tokens": 0}, 0),
        ({"max_completion_tokens": 128}, 128),
        ({"max_tokens": 64}, 64),
        ({"max_tokens": 64, "max_completion_tokens": 64}, 64),
        ({"max_tokens": None, "max_completion_tokens": 32}, 32),
    ],
)
def test_max_tokens(fields, expected):
    assert parse(body(**fields)).max_tokens == expected


@pytest.mark.parametrize(
    "fields, param, code",
    [
        ({"max_tokens": 64, "max_completion_tokens": 65}, "max_tokens", "invalid_value"),
        ({"max_tokens": -1}, "max_tokens", "invalid_value"),
        ({"max_completion_tokens": -5}, "max_completion_tokens", "invalid_value"),
        ({"max_tokens": True}, "max_tokens", "invalid_type"),
        ({"max_completion_tokens": 12.5}, "max_completion_tokens", "invalid_type"),
        ({"max_tokens": "64"}, "max_tokens", "invalid_type"),
    ],
)
def test_malformed_max_tokens(fields, param, code):
    rejected(body(**fields), param=param, code=code)


def test_sampling_fields_map_to_overrides():
    request = parse(
        body(temperature=0, top_p=1, top_k=20, min_p=0.05, presence_penalty=-2, frequency_penalty=2.0, seed=-(2**63))
    )
    assert request.sampling == SamplingOverrides(
        temperature=0.0, top_p=1.0, top_k=20, min_p=0.05, presence_penalty=-2.0, frequency_penalty=2.0, seed=-(2**63)
    )
    assert isinstance(request.sampling.temperature, float)
    assert parse(body(top_k=0, seed=2**63 - 1, temperature=2)).sampling == SamplingOverrides(
        temperature=2.0, top_k=0, seed=2**63 - 1
    )


def test_null_sampling_fields_are_not_given():
    fields = dict.fromkeys(["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed"])
    assert parse(body(**fields)).sampling == SamplingOverrides()


@pytest.mark.parametrize(
    "field, value, code",
    [
        ("temperature", 2.01, "invalid_value"),
        ("temperature", -0.1, "invalid_value"),
        ("temperature", float("nan"), "invalid_value"),
        ("temperature", "0.7", "invalid_type"),
        ("temperature", True, "invalid_type"),
        ("top_p", 1.5, "invalid_value"),
        ("top_p", float("inf"), "invalid_value"),
        ("top_k", 21, "invalid_value"),
        ("top_k", -1, "invalid_value"),
        ("top_k", 5.0, "invalid_type"),
        ("top_k", 5.5, "invalid_type"),
        ("min_p", 1.01, "invalid_value"),
        ("min_p", -0.01, "invalid_value"),
        ("presence_penalty", 2.5, "invalid_value"),
        ("frequency_penalty", -2.5, "invalid_value"),
        ("frequency_penalty", float("-inf"), "invalid_value"),
        ("seed", 2**63, "invalid_value"),
        ("seed", -(2**63) - 1, "invalid_value"),
        ("seed", 1.5, "invalid_type"),
        ("seed", False, "invalid_type"),
    ],
)
def test_malformed_sampling_fields(field, value, code):
    rejected(body(**{field: value}), param=field, code=code)


@pytest.mark.parametrize(
    "stop, expected",
    [
        (None, []),
        ("END", ["END"]),
        ([], []),
        (["a", "b", "c", "d"], ["a", "b", "c", "d"]),
        (["\n\n", "x"], ["\n\n", "x"]),
    ],
)
def test_stop(stop, expected):
    assert parse(body(stop=stop)).stop == expected


@pytest.mark.parametrize(
    "stop, param, code",
    [
        (["a", "b", "c", "d", "e"], "stop", "invalid_value"),
        ("", "stop", "invalid_value"),
        (["a", ""], "stop[1]", "invalid_value"),
        ([1], "stop[0]", "invalid_type"),
        ({"s": "x"}, "stop", "invalid_type"),
        (5, "stop", "invalid_type"),
    ],
)
def test_malformed_stop(stop, param, code):
    rejected(body(stop=stop), param=param, code=code)


# ---- rejected capabilities and neutral values --------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 1},
        {"n": None},
        {"response_format": {"type": "text"}},
        {"response_format": None},
        {"modalities": ["text"]},
        {"modalities": None},
        {"audio": None},
        {"logit_bias": {}},
        {"logit_bias": {"50256": 0, "13": 0.0}},
        {"logit_bias": None},
        {"logprobs": False},
        {"logprobs": None},
        {"top_logprobs": 0},
        {"verbosity": "medium"},
        {"verbosity": None},
        {"store": False},
        {"store": None},
        {"functions": []},
        {"functions": None},
        {"function_call": "none"},
        {"function_call": "auto"},
        {"function_call": None},
        {"web_search_options": None},
        {"moderation": None},
        {"repetition_penalty": 1},
        {"repetition_penalty": 1.0},
        {"repetition_penalty": None},
        {"mm_processor_kwargs": {}},
        {"mm_processor_kwargs": {"max_pixels": None, "fps": None}},
        {"mm_processor_kwargs": None},
        {"prediction": {"type": "content", "content": "def f(): pass"}},
        {"prediction": {"type": "content", "content": [{"type": "text", "text": "x"}]}},
        {"metadata": {"session": "abc"}},
        {"user": "user-1"},
        {"safety_identifier": "hash"},
        {"service_tier": "flex"},
        {"prompt_cache_key": "k"},
        {"prompt_cache_retention": "24h"},
        {"prompt_cache_retention": "in_memory"},
        {"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}},
        {"prompt_cache_options": {}},
        {"stream_options": {"include_obfuscation": False}},
        *(
            {alias: None}
            for alias in (
                "grammar",
                "structured_outputs",
                "guided_json",
                "guided_regex",
                "guided_choice",
                "guided_grammar",
            )
        ),
    ],
)
def test_neutral_and_advisory_values_are_accepted(fields):
    request = parse(body(**fields))
    assert [m.text for m in request.conversation.messages] == ["Hi"]
    assert request.sampling == SamplingOverrides()
    assert request.tools_enabled is False


def test_an_audio_configuration_with_text_only_modalities_is_neutral():
    audio = {"voice": "alloy", "format": "wav"}
    request = parse(body(modalities=["text"], audio=audio))
    assert [m.text for m in request.conversation.messages] == ["Hi"]
    assert request.sampling == SamplingOverrides()
    unsupported(body(modalities=["text", "audio"], audio=audio), "modalities", "audio output")
    rejected(body(modalities=["text"], audio="alloy"), param="audio", code="invalid_type")


@pytest.mark.parametrize(
    "fields, param, guarantee",
    [
        ({"n": 2}, "n", "more than one choice"),
        ({"modalities": ["text", "audio"]}, "modalities", "audio output"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio output"),
        ({"logit_bias": {"50256": 0, "13": -100}}, "logit_bias", "logit biasing"),
        ({"web_search_options": {}}, "web_search_options", "web search"),
        ({"web_search_options": {"search_context_size": "low"}}, "web_search_options", "web search"),
        ({"moderation": {"model": "omni-moderation-latest"}}, "moderation", "moderation"),
        ({"verbosity": "low"}, "verbosity", "verbosity"),
        ({"verbosity": "high"}, "verbosity", "verbosity"),
        ({"store": True}, "store", "stored Chat Completions"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "legacy function calling"),
        ({"function_call": {"name": "f"}}, "function_call", "forced legacy function call"),
        ({"repetition_penalty": 1.1}, "repetition_penalty", "repetition penalty"),
        ({"mm_processor_kwargs": {"max_pixels": 1024}}, "mm_processor_kwargs.max_pixels", "multimodal processor"),
        ({"grammar": "root ::= 'a'"}, "grammar", "constrained decoding"),
        ({"structured_outputs": {"json": {}}}, "structured_outputs", "constrained decoding"),
        ({"guided_json": {"type": "object"}}, "guided_json", "constrained decoding"),
        ({"guided_regex": "[a-z]+"}, "guided_regex", "constrained decoding"),
        ({"guided_choice": ["yes", "no"]}, "guided_choice", "constrained decoding"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar", "constrained decoding"),
    ],
)
def test_options_requesting_unprovidable_behaviour_are_rejected(fields, param, guarantee):
    unsupported(body(**fields), param, guarantee)


@pytest.mark.parametrize(
    "fields, param, code",
    [
        ({"n": 0}, "n", "invalid_value"),
        ({"n": "1"}, "n", "invalid_type"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
        ({"response_format": {}}, "response_format.type", "missing_required_parameter"),
        ({"response_format": "text"}, "response_format", "invalid_type"),
        ({"modalities": ["image"]}, "modalities[0]", "invalid_value"),
        ({"modalities": []}, "modalities", "invalid_value"),
        ({"modalities": "text"}, "modalities", "invalid_type"),
        ({"logit_bias": [1]}, "logit_bias", "invalid_type"),
        ({"logit_bias": {"13": "5"}}, "logit_bias.13", "invalid_type"),
        ({"logit_bias": {"13": 101}}, "logit_bias.13", "invalid_value"),
        ({"logprobs": "yes"}, "logprobs", "invalid_type"),
        ({"top_logprobs": -1}, "top_logprobs", "invalid_value"),
        ({"top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({"verbosity": "loud"}, "verbosity", "invalid_value"),
        ({"store": "no"}, "store", "invalid_type"),
        ({"functions": {}}, "functions", "invalid_type"),
        ({"function_call": "always"}, "function_call", "invalid_value"),
        ({"repetition_penalty": "1"}, "repetition_penalty", "invalid_type"),
        ({"mm_processor_kwargs": []}, "mm_processor_kwargs", "invalid_type"),
        ({"prediction": {"type": "diff", "content": "x"}}, "prediction.type", "invalid_value"),
        ({"prediction": {"type": "content", "content": 3}}, "prediction.content", "invalid_type"),
        ({"prediction": "x"}, "prediction", "invalid_type"),
        ({"metadata": {"k": 1}}, "metadata.k", "invalid_type"),
        ({"metadata": "k"}, "metadata", "invalid_type"),
        ({"user": 7}, "user", "invalid_type"),
        ({"safety_identifier": 7}, "safety_identifier", "invalid_type"),
        ({"service_tier": 7}, "service_tier", "invalid_type"),
        ({"prompt_cache_key": 7}, "prompt_cache_key", "invalid_type"),
        ({"prompt_cache_retention": "forever"}, "prompt_cache_retention", "invalid_value"),
        ({"prompt_cache_options": {"mode": "always"}}, "prompt_cache_options.mode", "invalid_value"),
        ({"prompt_cache_options": {"ttl": 30}}, "prompt_cache_options.ttl", "invalid_type"),
        ({"prompt_cache_options": "explicit"}, "prompt_cache_options", "invalid_type"),
    ],
)
def test_malformed_option_values(fields, param, code):
    rejected(body(**fields), param=param, code=code)


def test_explicit_prompt_cache_mode_turns_off_the_implicit_candidate():
    assert parse(body(prompt_cache_options={"mode": "explicit"})).prompt_cache_implicit is False
    assert parse(body(prompt_cache_options={"mode": "implicit"})).prompt_cache_implicit is True


# ---- streaming and observation switches --------------------------------------------------------


def test_stream_switches():
    request = parse(
        body(stream=True, stream_options={"include_usage": True}, timings_per_token=True, return_progress=True)
    )
    assert (request.stream, request.include_usage, request.timings_per_token, request.return_progress) == (
        True,
        True,
        True,
        True,
    )
    request = parse(body(stream=False, stream_options=None, timings_per_token=None, return_progress=False))
    assert (request.stream, request.include_usage, request.timings_per_token, request.return_progress) == (
        False,
        False,
        False,
        False,
    )


@pytest.mark.parametrize(
    "fields, param, code",
    [
        ({"stream": "true"}, "stream", "invalid_type"),
        ({"stream": 1}, "stream", "invalid_type"),
        ({"stream_options": True}, "stream_options", "invalid_type"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "invalid_type"),
        ({"stream_options": {"include_obfuscation": 1}}, "stream_options.include_obfuscation", "invalid_type"),
        ({"timings_per_token": 1}, "timings_per_token", "invalid_type"),
        ({"return_progress": "on"}, "return_progress", "invalid_type"),
    ],
)
def test_malformed_stream_switches(fields, param, code):
    rejected(body(**fields), param=param, code=code)


# ---- tools and tool choice ---------------------------------------------------------------------

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"unit": {"type": "string", "enum": ["C", "F"]}, "city": {"type": "string"}},
    "required": ["city"],
}


def declared_tools() -> list[dict]:
    return [
        tool("weather", copy.deepcopy(WEATHER_SCHEMA), description="Current weather"),
        tool("time"),
        tool("search", {"type": "object", "properties": {"q": {"type": "string"}}}, strict=False),
    ]


def test_tools_keep_declaration_and_schema_member_order():
    request = parse(body(tools=declared_tools()))
    assert request.tools_enabled is True
    assert list(request.callable_tools) == ["weather", "time", "search"]
    assert request.callable_tools["time"] is None
    assert list(request.callable_tools["weather"]) == ["type", "properties", "required"]
    assert list(request.callable_tools["weather"]["properties"]) == ["unit", "city"]
    tools = request.conversation.tools
    assert [(t.name, t.description) for t in tools] == [
        ("weather", "Current weather"),
        ("time", None),
        ("search", None),
    ]
    assert tools[0].parameters == WEATHER_SCHEMA


@pytest.mark.parametrize("tools", [None, []])
def test_no_tools_means_tools_disabled(tools):
    request = parse(body(tools=tools))
    assert request.tools_enabled is False and request.callable_tools == {} and request.conversation.tools == []


@pytest.mark.parametrize(
    "tools, param, code",
    [
        ({"type": "function"}, "tools", "invalid_type"),
        (["weather"], "tools[0]", "invalid_type"),
        ([{"function": {"name": "f"}}], "tools[0].type", "missing_required_parameter"),
        ([{"type": "function"}], "tools[0].function", "invalid_type"),
        ([tool("")], "tools[0].function.name", "invalid_value"),
        ([{"type": "function", "function": {"name": 3}}], "tools[0].function.name", "invalid_type"),
        ([tool("f"), tool("g"), tool("f")], "tools[2].function.name", "invalid_value"),
        ([tool("f", description=3)], "tools[0].function.description", "invalid_type"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "object"}}],
            "tools[0].function.parameters",
            "invalid_type",
        ),
        ([tool("f", strict="yes")], "tools[0].function.strict", "invalid_type"),
    ],
)
def test_malformed_tools(tools, param, code):
    rejected(body(tools=tools), param=param, code=code)


def test_strict_tools_constrain_the_calls_of_an_auto_choice():
    request = parse(body(tools=[tool("f"), tool("g", strict=True)]))
    calls = request.options.answer.calls
    assert [t.name for t in calls.tools] == ["f", "g"] and not calls.required and calls.parallel
    assert calls.tools[1].path == "tools[1].function.parameters"
    assert parse(body(tools=[tool("f"), tool("g", strict=False)])).options.answer is None
    rejected(body(tools=[tool("g", strict="yes")]), param="tools[0].function.strict", code="invalid_type")


@pytest.mark.parametrize("kind", ["custom", "web_search", "file_search"])
def test_non_function_tools_are_unsupported(kind):
    unsupported(body(tools=[tool("f"), {"type": kind, kind: {"name": "x"}}]), "tools[1].type", "only function tools")


@pytest.mark.parametrize("choice", [None, "auto"])
def test_tool_choice_auto(choice):
    request = parse(body(tools=declared_tools(), tool_choice=choice))
    assert request.tools_enabled is True and list(request.callable_tools) == ["weather", "time", "search"]


def test_tool_choice_none_keeps_tools_in_the_prompt_but_calls_stay_text():
    request = parse(body(tools=declared_tools(), tool_choice="none"))
    assert request.tools_enabled is False and request.callable_tools == {}
    assert [t.name for t in request.conversation.tools] == ["weather", "time", "search"]


def test_allowed_tools_filter_without_reordering():
    choice = {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "auto",
            "tools": [
                {"type": "function", "function": {"name": "search"}},
                {"type": "function", "function": {"name": "weather"}},
            ],
        },
    }
    request = parse(body(tools=declared_tools(), tool_choice=choice))
    assert request.tools_enabled is True
    assert list(request.callable_tools) == ["weather", "search"]
    assert [t.name for t in request.conversation.tools] == ["weather", "time", "search"]


def test_allowed_tools_with_an_empty_list_disables_calls():
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}
    request = parse(body(tools=declared_tools(), tool_choice=choice))
    assert request.tools_enabled is False and request.callable_tools == {}


@pytest.mark.parametrize(
    "choice, callable_names, required, parallel",
    [
        ("required", ["weather", "time", "search"], True, True),
        ({"type": "function", "function": {"name": "time"}}, ["time"], True, False),
        (
            {
                "type": "allowed_tools",
                "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "time"}}]},
            },
            ["time"],
            True,
            True,
        ),
    ],
)
def test_forcing_tool_choices_constrain_the_answer_to_calls(choice, callable_names, required, parallel):
    request = parse(body(tools=declared_tools(), tool_choice=choice))
    assert list(request.callable_tools) == callable_names
    calls = request.options.answer.calls
    assert [t.name for t in calls.tools] == callable_names
    assert (calls.required, calls.parallel) == (required, parallel)


def test_forcing_an_undeclared_or_custom_tool_is_rejected():
    choice = {"type": "function", "function": {"name": "nope"}}
    rejected(body(tools=declared_tools(), tool_choice=choice), param="tool_choice.function.name", code="invalid_value")
    unsupported(body(tools=declared_tools(), tool_choice={"type": "custom", "custom": {"name": "x"}}), "tool_choice",
                "custom tools")
    rejected(body(tool_choice="required"), param="tool_choice", code="invalid_value")


@pytest.mark.parametrize(
    "choice, param, code",
    [
        ("sometimes", "tool_choice", "invalid_value"),
        (3, "tool_choice", "invalid_value"),
        ({"type": "any"}, "tool_choice.type", "invalid_value"),
        ({"type": "allowed_tools"}, "tool_choice.allowed_tools", "invalid_type"),
        (
            {"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": []}},
            "tool_choice.allowed_tools.mode",
            "invalid_value",
        ),
        (
            {"type": "allowed_tools", "allowed_tools": {"mode": "auto"}},
            "tool_choice.allowed_tools.tools",
            "invalid_type",
        ),
        (
            {
                "type": "allowed_tools",
                "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]},
            },
            "tool_choice.allowed_tools.tools[0].function.name",
            "invalid_value",
        ),
        (
            {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"name": "time"}]}},
            "tool_choice.allowed_tools.tools[0]",
            "invalid_value",
        ),
    ],
)
def test_malformed_tool_choice(choice, param, code):
    rejected(body(tools=declared_tools(), tool_choice=choice), param=param, code=code)


def test_parallel_tool_calls_false_with_enabled_tools_allows_one_call():
    calls = parse(body(tools=declared_tools(), parallel_tool_calls=False)).options.answer.calls
    assert not calls.required and not calls.parallel and len(calls.tools) == 3


@pytest.mark.parametrize(
    "response_format, schema, path",
    [
        ({"type": "json_object"}, {"type": "object"}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}, "strict": True}},
         {"type": "array"}, "response_format.json_schema.schema"),
    ],
)
def test_json_response_formats_constrain_the_answer(response_format, schema, path):
    answer = parse(body(response_format=response_format)).options.answer
    assert answer.json.schema == schema and answer.json.path == path and answer.calls is None
    assert parse(body(response_format={"type": "text"})).options.answer is None


@pytest.mark.parametrize(
    "response_format, param",
    [
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "response_format.json_schema.schema"),
        ({"type": "xml"}, "response_format.type"),
    ],
)
def test_malformed_response_formats_name_the_field(response_format, param):
    error = rejected(body(response_format=response_format), param=param, code=ANY)
    assert error.status == 400


def test_logprobs_and_top_logprobs():
    assert parse(body()).options.top_logprobs is None
    assert parse(body(logprobs=True)).options.top_logprobs == 0
    assert parse(body(logprobs=True, top_logprobs=20)).options.top_logprobs == 20
    assert parse(body(logprobs=False, top_logprobs=0)).options.top_logprobs is None
    rejected(body(top_logprobs=3), param="top_logprobs", code="invalid_value")
    rejected(body(logprobs=True, top_logprobs=21), param="top_logprobs", code="invalid_value")


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": declared_tools(), "parallel_tool_calls": True},
        {"tools": declared_tools(), "parallel_tool_calls": None},
        {"tools": declared_tools(), "parallel_tool_calls": False, "tool_choice": "none"},
        {"parallel_tool_calls": False},
        {"tools": [], "parallel_tool_calls": False},
    ],
)
def test_parallel_tool_calls_neutral_values(fields):
    parse(body(**fields))


def test_parallel_tool_calls_must_be_boolean():
    rejected(body(parallel_tool_calls="no"), param="parallel_tool_calls", code="invalid_type")


# ---- reasoning_effort / enable_thinking / preserve_thinking --------------------------------------


def thinking(caps: TemplateCapabilities, **fields: Any) -> tuple[bool | None, str | None, bool | None]:
    conversation = parse(body(**fields), caps).conversation
    return conversation.enable_thinking, conversation.reasoning_effort, conversation.preserve_thinking


@pytest.mark.parametrize("caps", CAPS.values(), ids=CAPS.keys())
def test_effort_none_disables_thinking_everywhere(caps):
    assert thinking(caps, reasoning_effort="none") == (False, None, None)
    assert parse(body(reasoning_effort="none"), caps).requested_reasoning_effort == "none"


@pytest.mark.parametrize("effort", ["low", "medium", "xhigh"])
def test_exposed_effort_tier_selects_it_and_enables_thinking(effort):
    assert thinking(QWEN38, reasoning_effort=effort) == (True, effort, None)
    assert thinking(QWEN38, reasoning_effort=effort, enable_thinking=True) == (True, effort, None)
    assert parse(body(reasoning_effort=effort), QWEN38).requested_reasoning_effort == effort


@pytest.mark.parametrize(
    "caps, effort",
    [
        (QWEN35, "low"),
        (QWEN35, "medium"),
        (QWEN35, "xhigh"),
        (CHATML, "low"),
        (CHATML, "xhigh"),
        *((caps, effort) for caps in CAPS.values() for effort in ("minimal", "high", "max")),
    ],
)
def test_effort_not_exposed_by_the_template(caps, effort):
    error = rejected(
        body(reasoning_effort=effort), param="reasoning_effort", code="reasoning_effort_not_supported", caps=caps
    )
    assert effort in error.message


def test_protocol_efforts_are_accepted_when_the_template_exposes_them():
    caps = TemplateCapabilities(
        supports_thinking_switch=True,
        thinking_default=True,
        effort_tiers=("none", "minimal", "low", "medium", "high", "max"),
        default_effort="medium",
        supports_preserve_thinking=False,
        preserve_thinking_default=False,
        think_open="<think>",
        think_close="</think>",
    )
    for effort in ("minimal", "high", "max"):
        assert thinking(caps, reasoning_effort=effort) == (True, effort, None)
    # "none" reaches the template only when it is one of the template's own tiers.
    assert thinking(caps, reasoning_effort="none") == (False, "none", None)


@pytest.mark.parametrize(
    "value, code", [("ultra", "invalid_value"), ("LOW", "invalid_value"), (3, "invalid_type"), (True, "invalid_type")]
)
def test_malformed_reasoning_effort(value, code):
    rejected(body(reasoning_effort=value), param="reasoning_effort", code=code, caps=QWEN38)


def test_null_reasoning_effort_is_not_given():
    assert thinking(QWEN38, reasoning_effort=None) == (None, None, None)
    assert parse(body(reasoning_effort=None), QWEN38).requested_reasoning_effort is None


@pytest.mark.parametrize("caps", [QWEN35, QWEN38], ids=["qwen3.5", "qwen3.8"])
@pytest.mark.parametrize("spelling", ["top", "kwargs", "both"])
@pytest.mark.parametrize("value", [True, False])
def test_enable_thinking_spellings(caps, spelling, value):
    fields: dict[str, Any] = {}
    if spelling in ("top", "both"):
        fields["enable_thinking"] = value
    if spelling in ("kwargs", "both"):
        fields["chat_template_kwargs"] = {"enable_thinking": value}
    assert thinking(caps, **fields) == (value, None, None)


@pytest.mark.parametrize("option", ["enable_thinking", "preserve_thinking"])
def test_disagreeing_spellings_conflict(option):
    error = rejected(
        body(**{option: True, "chat_template_kwargs": {option: False}}),
        param=option,
        code="conflicting_template_option",
    )
    assert f"chat_template_kwargs.{option}" in error.message


def test_null_spelling_does_not_conflict():
    assert thinking(QWEN35, enable_thinking=None, chat_template_kwargs={"enable_thinking": False}) == (
        False,
        None,
        None,
    )
    assert thinking(QWEN35, enable_thinking=True, chat_template_kwargs={"enable_thinking": None}) == (True, None, None)


@pytest.mark.parametrize(
    "caps, fields, param",
    [
        (QWEN35, {"reasoning_effort": "none", "enable_thinking": True}, "enable_thinking"),
        (
            QWEN38,
            {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
            "chat_template_kwargs.enable_thinking",
        ),
        (QWEN38, {"reasoning_effort": "low", "enable_thinking": False}, "enable_thinking"),
        (
            QWEN38,
            {"reasoning_effort": "xhigh", "chat_template_kwargs": {"enable_thinking": False}},
            "chat_template_kwargs.enable_thinking",
        ),
        (CHATML, {"reasoning_effort": "none", "enable_thinking": True}, "enable_thinking"),
    ],
)
def test_effort_contradicting_enable_thinking_conflicts(caps, fields, param):
    rejected(body(**fields), param=param, code="conflicting_template_option", caps=caps)


@pytest.mark.parametrize("caps", CAPS.values(), ids=CAPS.keys())
def test_effort_none_agrees_with_enable_thinking_false(caps):
    assert thinking(caps, reasoning_effort="none", enable_thinking=False) == (False, None, None)


@pytest.mark.parametrize("spelling", ["top", "kwargs"])
def test_enable_thinking_true_without_thinking_support_is_unsupported(spelling):
    if spelling == "top":
        payload, param = body(enable_thinking=True), "enable_thinking"
    else:
        payload, param = body(chat_template_kwargs={"enable_thinking": True}), "chat_template_kwargs.enable_thinking"
    unsupported(payload, param, "enabling thinking", caps=CHATML)


def test_enable_thinking_false_without_thinking_support_is_neutral():
    assert thinking(CHATML, enable_thinking=False) == (False, None, None)
    assert thinking(CHATML, chat_template_kwargs={"enable_thinking": False}) == (False, None, None)


def test_template_that_always_thinks_cannot_turn_thinking_off():
    assert thinking(ALWAYS_THINKS, enable_thinking=True) == (True, None, None)
    unsupported(body(enable_thinking=False), "enable_thinking", "disabling thinking", caps=ALWAYS_THINKS)
    rejected(
        body(reasoning_effort="none"),
        param="reasoning_effort",
        code="reasoning_effort_not_supported",
        caps=ALWAYS_THINKS,
    )


@pytest.mark.parametrize("caps", [QWEN35, QWEN38], ids=["qwen3.5", "qwen3.8"])
@pytest.mark.parametrize("value", [True, False])
def test_preserve_thinking_where_supported(caps, value):
    assert thinking(caps, preserve_thinking=value) == (None, None, value)
    assert thinking(caps, chat_template_kwargs={"preserve_thinking": value}) == (None, None, value)
    assert thinking(caps, preserve_thinking=value, chat_template_kwargs={"preserve_thinking": value}) == (
        None,
        None,
        value,
    )


def test_preserve_thinking_without_support():
    assert thinking(CHATML, preserve_thinking=False) == (None, None, False)
    unsupported(body(preserve_thinking=True), "preserve_thinking", "closed-turn reasoning", caps=CHATML)
    unsupported(
        body(chat_template_kwargs={"preserve_thinking": True}),
        "chat_template_kwargs.preserve_thinking",
        "closed-turn reasoning",
        caps=CHATML,
    )


def test_all_template_options_together():
    fields = {
        "reasoning_effort": "medium",
        "chat_template_kwargs": {"enable_thinking": True, "preserve_thinking": False},
    }
    assert thinking(QWEN38, **fields) == (True, "medium", False)


@pytest.mark.parametrize(
    "fields, param, code",
    [
        ({"enable_thinking": "yes"}, "enable_thinking", "invalid_type"),
        ({"preserve_thinking": 1}, "preserve_thinking", "invalid_type"),
        (
            {"chat_template_kwargs": {"enable_thinking": "false"}},
            "chat_template_kwargs.enable_thinking",
            "invalid_type",
        ),
        ({"chat_template_kwargs": {"preserve_thinking": 0}}, "chat_template_kwargs.preserve_thinking", "invalid_type"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "invalid_type"),
    ],
)
def test_malformed_template_options(fields, param, code):
    rejected(body(**fields), param=param, code=code)


@pytest.mark.parametrize(
    "key, value", [("custom_instructions", "be brief"), ("reasoning_effort", "low"), ("tools_in_user", False)]
)
def test_other_chat_template_kwargs_are_rejected(key, value):
    unsupported(
        body(chat_template_kwargs={key: value}), f"chat_template_kwargs.{key}", "chat template variables", caps=QWEN38
    )


def test_null_chat_template_kwargs_are_neutral():
    assert thinking(QWEN38, chat_template_kwargs={"custom": None, "enable_thinking": None}) == (None, None, None)
    assert thinking(QWEN38, chat_template_kwargs=None) == (None, None, None)


# ---- one realistic request end to end ---------------------------------------------------------


def test_agent_loop_request():
    payload = {
        "model": MODEL,
        "messages": [
            {"role": "developer", "content": "You are a coding agent."},
            {"role": "user", "content": [{"type": "text", "text": "Fix "}, {"type": "text", "text": "the bug."}]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Need to read the file.",
                "tool_calls": [call("call_1", "read_file", '{"path": "a.py", "limit": 10}')],
            },
            {"role": "tool", "tool_call_id": "call_1", "name": "read_file", "content": "print(1)"},
        ],
        "tools": [tool("read_file", {"type": "object", "properties": {"path": {}, "limit": {}}})],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 2048,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "stop": ["<|endoftext|>"],
        "reasoning_effort": "medium",
        "chat_template_kwargs": {"preserve_thinking": True},
        "user": "u-1",
        "logprobs": False,
        "metadata": {"run": "7"},
    }
    request = parse(payload, QWEN38)
    conversation = request.conversation
    assert [m.role for m in conversation.messages] == ["developer", "user", "assistant", "tool"]
    assert conversation.messages[1].text == "Fix the bug."
    assert conversation.messages[2].reasoning == "Need to read the file."
    assert list(conversation.messages[2].tool_calls[0].arguments) == ["path", "limit"]
    assert (conversation.enable_thinking, conversation.reasoning_effort, conversation.preserve_thinking) == (
        True,
        "medium",
        True,
    )
    assert request.stream and request.include_usage
    assert request.max_tokens == 2048
    assert request.sampling == SamplingOverrides(temperature=0.6, top_p=0.95, top_k=20)
    assert request.stop == ["<|endoftext|>"]
    assert request.tools_enabled and list(request.callable_tools) == ["read_file"]
    assert request.requested_reasoning_effort == "medium"
