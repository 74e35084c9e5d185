"""parse_messages_request: the Messages lowering rules, checked on the Conversation they produce.

Pure-Python: bodies are plain dicts, capabilities are built directly for a Qwen3.5-like
template (thinking switch, no effort tiers), a Qwen3.8-like one (low/medium/xhigh) and plain
ChatML (no thinking). The HTTP-level behaviour (status, envelope, request_id) is checked end
to end in test_anthropic_messages.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from ninfer.frontend.capabilities import TemplateCapabilities
from ninfer.frontend.conversation import Message, TextPart, ToolCall
from ninfer.server.anthropic_messages.lowering import TOOL_ERROR_MARKER
from ninfer.server.anthropic_messages.request import MessagesRequest, parse_messages_request
from ninfer.server.errors import APIError
from ninfer.server.request_context import RequestContext
from tests.server.capability_sets import CHATML, QWEN35, QWEN38

BILLING = "x-anthropic-billing-header: cc_version=2.1.0; cc_entrypoint=cli;"
TOOL = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
EPHEMERAL = {"type": "ephemeral"}


def parse(body: dict[str, Any], caps: TemplateCapabilities = QWEN35, **kwargs: Any) -> MessagesRequest:
    full = {"model": "claude-sonnet-local", "max_tokens": 64, **body}
    full.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return parse_messages_request(full, RequestContext("local", caps, default_max_tokens=8192), **kwargs)


def rejection(body: dict[str, Any], caps: TemplateCapabilities = QWEN35, **kwargs: Any) -> APIError:
    with pytest.raises(APIError) as err:
        parse(body, caps, **kwargs)
    return err.value


def shape(messages: list[Message]) -> list[tuple]:
    """Role, text, reasoning, call ids and result id of each message: what the template sees."""
    return [(m.role, m.text, m.reasoning, [c.call_id for c in m.tool_calls], m.tool_call_id) for m in messages]


def flagged(messages: list[Message]) -> list[str]:
    return [p.text for m in messages for p in m.content if isinstance(p, TextPart) and p.cache_breakpoint]


# ---- system and the billing header -----------------------------------------------------------


def test_billing_header_block_is_consumed_with_its_cache_control():
    system = [
        {"type": "text", "text": BILLING, "cache_control": EPHEMERAL},
        {"type": "text", "text": "You are Claude Code."},
    ]
    request = parse({"system": system})
    assert shape(request.conversation.messages[:1]) == [("system", "You are Claude Code.", None, [], None)]
    assert flagged(request.conversation.messages) == []  # the marker went with the block, not to its neighbour
    # Its marker does not take one of the four slots either.
    four = [{"type": "text", "text": f"s{i}", "cache_control": EPHEMERAL} for i in range(4)]
    assert len(flagged(parse({"system": [system[0], *four]}).conversation.messages)) == 4


def test_billing_header_changes_never_change_the_conversation():
    def conversation(header: str):
        return parse({"system": [{"type": "text", "text": header}, {"type": "text", "text": "Rules."}]}).conversation

    assert conversation(BILLING) == conversation(BILLING.replace("2.1.0", "9.9.9"))
    assert conversation(BILLING) == parse({"system": "Rules."}).conversation


def test_billing_text_elsewhere_stays_prompt_content():
    as_string = parse({"system": BILLING}).conversation.messages[0]
    assert as_string.text == BILLING
    later = parse({"system": [{"type": "text", "text": "Rules."}, {"type": "text", "text": BILLING}]})
    assert later.conversation.messages[0].text == "Rules." + BILLING
    inline = parse(
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "system", "content": BILLING},
                {"role": "user", "content": "Go"},
            ]
        }
    )
    assert shape(inline.conversation.messages)[1] == ("system", BILLING, None, [], None)


def test_only_a_billing_header_means_no_system_message():
    request = parse({"system": [{"type": "text", "text": BILLING}]})
    assert [m.role for m in request.conversation.messages] == ["user"]


# ---- history normalisation -------------------------------------------------------------------


def test_consecutive_turns_join_without_separators_and_system_keeps_its_position():
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "user", "content": [{"type": "text", "text": " there"}, {"type": "text", "text": "!"}]},
        {"role": "assistant", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": " again"}]},
        {"role": "system", "content": "Be brief from now on."},
        {"role": "user", "content": "Why?"},
    ]
    request = parse({"system": "Top.", "messages": messages})
    assert shape(request.conversation.messages) == [
        ("system", "Top.", None, [], None),
        ("user", "Hello there!", None, [], None),
        ("assistant", "Hi again", None, [], None),
        ("system", "Be brief from now on.", None, [], None),
        ("user", "Why?", None, [], None),
    ]


def test_thinking_history_becomes_reasoning_and_signature_is_not_semantic():
    def history(signature: str) -> list[dict]:
        return [
            {"role": "user", "content": "Q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Step one.", "signature": signature},
                    {"type": "thinking", "thinking": " Step two.", "signature": signature},
                    {"type": "text", "text": "Answer."},
                ],
            },
            {"role": "user", "content": "Next"},
        ]

    request = parse({"messages": history("sig-A")})
    assert shape(request.conversation.messages)[1] == ("assistant", "Answer.", "Step one. Step two.", [], None)
    assert request.conversation == parse({"messages": history("a completely different signature")}).conversation


def test_tool_results_are_paired_in_call_order_with_explicit_errors():
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 2}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "is_error": True,
                    "content": [{"type": "text", "text": "timeout"}, {"type": "text", "text": " after 5s"}],
                },
                {"type": "text", "text": "Summarise."},
            ],
        },
    ]
    request = parse({"messages": messages, "tools": [TOOL]})
    assert shape(request.conversation.messages) == [
        ("user", "Weather in Paris and Rome?", None, [], None),
        ("assistant", "Checking.", None, ["toolu_1", "toolu_2"], None),
        ("tool", TOOL_ERROR_MARKER + "timeout after 5s", None, [], "toolu_1"),
        ("tool", "sunny", None, [], "toolu_2"),
        ("user", "Summarise.", None, [], None),
    ]
    call = request.conversation.messages[1].tool_calls[0]
    assert call == ToolCall("get_weather", {"city": "Paris", "days": 2}, "toolu_1")
    assert list(call.arguments) == ["city", "days"]  # member order kept


def test_results_only_turn_and_history_that_begins_with_results():
    opened = parse(
        {
            "messages": [
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_old", "content": "42"}]},
                {"role": "assistant", "content": "The answer is 42."},
                {"role": "user", "content": "Thanks"},
            ]
        }
    )
    assert shape(opened.conversation.messages)[0] == ("tool", "42", None, [], "toolu_old")
    assert [m.role for m in opened.conversation.messages] == ["tool", "assistant", "user"]


@pytest.mark.parametrize(
    "results, fragment",
    [
        ([], "need one leading tool_result"),
        ([{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a"}], "'toolu_2'"),
        (
            [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "b"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "c"},
            ],
            "a second tool_result",
        ),
        (
            [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a"},
                {"type": "tool_result", "tool_use_id": "toolu_9", "content": "b"},
            ],
            "answers no tool_use",
        ),
        (
            [
                {"type": "text", "text": "first"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "b"},
            ],
            "must come before other content",
        ),
    ],
)
def test_tool_result_pairing_rejections(results, fragment):
    messages = [
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}},
            ],
        },
        {"role": "user", "content": results or "no results"},
    ]
    error = rejection({"messages": messages})
    assert error.status == 400 and fragment in error.message


def test_results_mid_history_without_calls_are_rejected():
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]},
    ]
    assert "has no tool_use" in rejection({"messages": messages}).message


# ---- assistant prefill -----------------------------------------------------------------------


def test_final_text_assistant_turn_is_a_prefill():
    request = parse(
        {
            "messages": [
                {"role": "user", "content": "Greek name for Sun?"},
                {"role": "assistant", "content": "The best answer is ("},
            ]
        }
    )
    assert request.conversation.continue_final_message
    assert request.conversation.messages[-1].text == "The best answer is ("


def test_empty_final_assistant_turn_prefills_nothing():
    request = parse({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""}]})
    assert not request.conversation.continue_final_message
    assert [m.role for m in request.conversation.messages] == ["user"]


@pytest.mark.parametrize(
    "final, extra, param",
    [
        (
            [{"type": "thinking", "thinking": "hmm", "signature": "s"}, {"type": "text", "text": "So"}],
            {},
            "messages[1]",
        ),
        ([{"type": "text", "text": "So"}], {"thinking": {"type": "adaptive"}}, "thinking"),
        (
            [{"type": "text", "text": "So"}],
            {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048},
            "thinking",
        ),
        ([{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}], {}, "messages[1]"),
        ([{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}], {}, "messages[1].content[0].type"),
    ],
)
def test_prefill_restrictions(final, extra, param):
    body = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": final}], **extra}
    error = rejection(body)
    assert error.status == 400 and error.param == param


def test_prefill_is_allowed_with_thinking_disabled_or_omitted():
    for extra in ({}, {"thinking": {"type": "disabled"}}):
        body = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A:"}], **extra}
        assert parse(body).conversation.continue_final_message


# ---- cache_control ---------------------------------------------------------------------------


def test_block_level_cache_control_maps_to_breakpoints():
    tool = {**TOOL, "cache_control": EPHEMERAL}
    system = [{"type": "text", "text": "Rules.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Q", "cache_control": EPHEMERAL}]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "cold", "cache_control": EPHEMERAL}
            ],
        },
    ]
    request = parse({"tools": [tool], "system": system, "messages": messages})
    assert request.conversation.tools[0].cache_breakpoint
    assert flagged(request.conversation.messages) == ["Rules.", "Q", "cold"]


def test_more_than_four_block_breakpoints_are_rejected():
    system = [{"type": "text", "text": f"s{i}", "cache_control": EPHEMERAL} for i in range(5)]
    error = rejection({"system": system})
    assert error.status == 400 and "at most 4" in error.message


def test_request_level_marker_targets_the_last_cacheable_block():
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "last"}]},
    ]
    request = parse({"system": "Rules.", "messages": messages, "cache_control": EPHEMERAL})
    assert flagged(request.conversation.messages) == ["last"]
    # A string-content final message is one block too.
    request = parse({"messages": [{"role": "user", "content": "only"}], "cache_control": EPHEMERAL})
    assert flagged(request.conversation.messages) == ["only"]


def test_request_level_marker_merges_conflicts_and_needs_a_free_slot():
    def body(last_ttl: str | None, others: int) -> dict:
        system = [{"type": "text", "text": f"s{i}", "cache_control": EPHEMERAL} for i in range(others)]
        last = {"type": "text", "text": "last"}
        if last_ttl:
            last["cache_control"] = {"type": "ephemeral", "ttl": last_ttl}
        return {
            "system": system or "Rules.",
            "messages": [{"role": "user", "content": [last]}],
            "cache_control": {"type": "ephemeral", "ttl": "5m"},
        }

    assert flagged(parse(body("5m", 3)).conversation.messages) == ["s0", "s1", "s2", "last"]  # merged: 4 slots
    conflict = rejection(body("1h", 0))
    assert conflict.param == "cache_control" and "ttl 1h" in conflict.message
    full = rejection(body(None, 4))
    assert full.param == "cache_control" and "fifth" in full.message
    assert flagged(parse(body(None, 3)).conversation.messages) == ["s0", "s1", "s2", "last"]


@pytest.mark.parametrize(
    "marker, param",
    [
        ({"type": "ephemeral", "ttl": "10m"}, "system[0].cache_control.ttl"),
        ({"type": "persistent"}, "system[0].cache_control.type"),
    ],
)
def test_cache_control_shapes(marker, param):
    error = rejection({"system": [{"type": "text", "text": "x", "cache_control": marker}]})
    assert error.param == param


def test_thinking_blocks_cannot_carry_cache_control():
    messages = [
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "t", "signature": "s", "cache_control": EPHEMERAL},
                {"type": "text", "text": "A"},
            ],
        },
        {"role": "user", "content": "Next"},
    ]
    assert rejection({"messages": messages}).param == "messages[1].content[0].cache_control"


# ---- thinking, effort, sampling --------------------------------------------------------------


def test_thinking_modes():
    assert parse({}).conversation.enable_thinking is None
    assert parse({"thinking": {"type": "disabled"}}).conversation.enable_thinking is False
    adaptive = parse({"thinking": {"type": "adaptive", "display": "summarized"}})
    assert adaptive.conversation.enable_thinking is True and adaptive.thinking_budget is None
    enabled = parse({"thinking": {"type": "enabled", "budget_tokens": 1500}, "max_tokens": 4000})
    assert enabled.conversation.enable_thinking is True and enabled.thinking_budget == 1500
    # The default output budget bounds budget_tokens when max_tokens is omitted.
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "thinking": {"type": "enabled", "budget_tokens": 2000},
    }
    assert parse_messages_request(body, RequestContext("local", QWEN35, 8192)).max_tokens == 8192
    with pytest.raises(APIError):
        parse_messages_request(body, RequestContext("local", QWEN35, 2000))


@pytest.mark.parametrize(
    "thinking, max_tokens, param, code",
    [
        ({"type": "enabled", "budget_tokens": 1023}, 4096, "thinking.budget_tokens", "invalid_value"),
        ({"type": "enabled", "budget_tokens": 4096}, 4096, "thinking.budget_tokens", "invalid_value"),
        ({"type": "enabled"}, 4096, "thinking.budget_tokens", "missing_required_parameter"),
        ({"type": "adaptive", "display": "hidden"}, 4096, "thinking.display", "invalid_value"),
        ({"type": "between_tools"}, 4096, "thinking.type", "unsupported_parameter"),
        ({"type": "sometimes"}, 4096, "thinking.type", "invalid_value"),
    ],
)
def test_thinking_rejections(thinking, max_tokens, param, code):
    error = rejection({"thinking": thinking, "max_tokens": max_tokens})
    assert (error.param, error.code) == (param, code)


def test_omitted_thinking_display_is_served_through_the_signature():
    request = parse({"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}, "max_tokens": 4096})
    assert request.thinking_omitted and request.conversation.enable_thinking is True
    assert request.thinking_budget == 1024
    assert not parse({"thinking": {"type": "adaptive", "display": "summarized"}}).thinking_omitted


def test_thinking_on_a_template_that_cannot_think_is_served_without_it():
    """Compatibility rule: Claude Code always asks for thinking; a plain template answers without."""
    for thinking in ({"type": "adaptive"}, {"type": "enabled", "budget_tokens": 1024}):
        request = parse({"thinking": thinking, "max_tokens": 4096}, CHATML)
        assert request.conversation.enable_thinking is None and request.thinking_budget is None
        assert request.notes == [f"thinking {thinking['type']!r} served without thinking (the template cannot think)"]
    assert parse({"thinking": {"type": "disabled"}}, CHATML).conversation.enable_thinking is False


def test_effort_maps_to_what_the_template_exposes():
    """Compatibility rule: an exposed tier as is; else the nearest tier (ties go up); plain
    thinking on a template without tiers; nothing on a template that cannot think."""
    cases = [
        ("low", QWEN38, "low", []),
        ("xhigh", QWEN38, "xhigh", []),
        ("high", QWEN38, "xhigh", ["output_config.effort 'high' served as 'xhigh', the template's nearest tier"]),
        ("max", QWEN38, "xhigh", ["output_config.effort 'max' served as 'xhigh', the template's nearest tier"]),
        ("low", QWEN35, None, ["output_config.effort 'low' served as plain thinking (the template has no effort tiers)"]),
        ("high", CHATML, None, ["output_config.effort 'high' ignored (the template cannot think)"]),
    ]
    for effort, caps, served, notes in cases:
        request = parse({"output_config": {"effort": effort}}, caps)
        assert (request.conversation.reasoning_effort, request.notes) == (served, notes), (effort, caps)
        assert request.requested_effort == effort
    assert rejection({"output_config": {"effort": "extreme"}}, QWEN38).code == "invalid_value"


def test_preserve_thinking_extension():
    assert parse({"preserve_thinking": True}).conversation.preserve_thinking is True
    assert rejection({"preserve_thinking": True}, CHATML).param == "preserve_thinking"


def test_sampling_stop_sequences_and_default_max_tokens():
    request = parse({"temperature": 0.2, "top_p": 0.9, "top_k": 5, "stop_sequences": ["\n\nHuman:", "END"]})
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.top_k) == (0.2, 0.9, 5)
    assert request.stop_sequences == ["\n\nHuman:", "END"]
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    assert parse_messages_request(body, RequestContext("local", QWEN35, 321)).max_tokens == 321


# ---- tools -----------------------------------------------------------------------------------


def test_tools_keep_schema_order_and_examples_reach_the_prompt():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    tool = {"name": "f", "input_schema": schema, "input_examples": [{"b": 1, "a": "x"}]}
    request = parse({"tools": [tool]})
    rendered = request.conversation.tools[0].parameters
    assert list(rendered) == ["type", "properties", "examples"] and rendered["examples"] == [{"b": 1, "a": "x"}]
    assert request.callable_tools == {"f": schema}  # the decoder types arguments from the client's schema


def test_tool_choice_auto_and_none():
    assert parse({"tools": [TOOL], "tool_choice": {"type": "auto"}}).callable_tools == {
        "get_weather": TOOL["input_schema"]
    }
    none = parse({"tools": [TOOL], "tool_choice": {"type": "none"}})
    assert none.callable_tools is None and [t.name for t in none.conversation.tools] == ["get_weather"]
    assert parse({}).callable_tools is None
    # Single-call enforcement only matters when something is callable.
    assert parse({"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}).callable_tools is None


def test_count_only_ignores_output_fields():
    body = {
        "max_tokens": 0,
        "temperature": 7,
        "stop_sequences": [""],
        "stream": "yes",
        "thinking": {"type": "enabled", "budget_tokens": 5000},
    }
    request = parse(body, count_only=True)
    assert request.conversation.enable_thinking is True


def test_context_management_accepts_only_the_no_op_edit():
    keep_all = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    assert parse({"context_management": keep_all, "thinking": {"type": "adaptive"}}).conversation.enable_thinking
    for edit in ({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
                 {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 30000}}):
        error = rejection({"context_management": {"edits": [edit]}})
        assert (error.param, error.code) == ("context_management.edits[0]", "unsupported_parameter")
