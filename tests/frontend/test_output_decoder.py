"""OutputDecoder: reasoning/content channels, held tool regions, token counting, split invariance."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import pytest

from ninfer.frontend.output_decoder import (
    ContentDelta,
    DecoderEvent,
    OutputDecoder,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from ninfer.frontend.tool_call_parser import FallbackReason

THINK_END = 248069  # the fake id of the </think> token
TOOLS: dict[str, Any] = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
    },
    "search": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}},
}
GUIDANCE = (
    "\n\nConsidering the limited time by the user, I have to give the solution based on the thinking directly now."
)


def call_block(name: str, arguments: dict[str, Any]) -> str:
    """Render a call as the Qwen 3.8 template does: strings verbatim, other values as JSON."""
    body = ""
    for key, value in arguments.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        body += f"<parameter={key}>\n{text}\n</parameter>\n"
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def render_turn(reasoning: str | None, content: str, calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """The assistant output a template replay of (reasoning, content, calls) tokenizes to."""
    text = "" if reasoning is None else reasoning.strip("\n") + "\n</think>\n\n"
    text += content.lstrip("\n") if reasoning is not None else content
    for index, (name, arguments) in enumerate(calls):
        if index:
            text += "\n"
        elif content.strip():
            text += "\n\n"
        text += call_block(name, arguments)
    return text


def check_events(decoder: OutputDecoder, events: list[DecoderEvent]) -> None:
    """Properties every event stream must have, whatever the input."""
    reasoning = [e.text for e in events if isinstance(e, ReasoningDelta)]
    content = [e.text for e in events if isinstance(e, ContentDelta)]
    assert "".join(reasoning) == decoder.reasoning_text
    assert "".join(content) == decoder.content_text
    assert all(reasoning) and all(content), "no empty deltas"
    first_other = next((i for i, e in enumerate(events) if not isinstance(e, ReasoningDelta)), len(events))
    assert not any(isinstance(e, ReasoningDelta) for e in events[first_other:]), "reasoning comes first"

    tool_events = [e for e in events if isinstance(e, ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd)]
    calls = decoder.tool_calls
    assert sum(isinstance(e, ToolCallStart) for e in tool_events) == len(calls)
    position = 0
    for call in calls:
        start = tool_events[position]
        assert start == ToolCallStart(call.index, call.name)
        position += 1
        pieces = []
        while isinstance(tool_events[position], ToolCallArgumentsDelta):
            assert tool_events[position].index == call.index
            pieces.append(tool_events[position].text)
            position += 1
        assert tool_events[position] == ToolCallEnd(call.index, call.arguments)
        assert pieces and "".join(pieces) == call.arguments
        position += 1
    assert [c.index for c in calls] == list(range(len(calls)))
    assert decoder.diagnostics.structured_calls == len(calls)


def decode(
    pieces: Sequence[str],
    *,
    thinking: bool = True,
    tools: dict[str, Any] | None = TOOLS,
    tolerant: bool = False,
) -> tuple[OutputDecoder, list[DecoderEvent]]:
    """Feed one synthetic token per piece (never the </think> id: the close is seen in text)."""
    decoder = OutputDecoder(thinking, tools, tolerant, THINK_END)
    events: list[DecoderEvent] = []
    for token_id, piece in enumerate(pieces):
        events += decoder.feed([token_id], piece)
    events += decoder.finish()
    check_events(decoder, events)
    return decoder, events


def outcome(decoder: OutputDecoder) -> tuple:
    return decoder.reasoning_text, decoder.content_text, decoder.tool_calls, decoder.diagnostics


def splits(text: str) -> list[list[str]]:
    """Every 1-char and 2-char chunking, every two-way cut, and seeded random chunkings."""
    result = [list(text), [text[i : i + 2] for i in range(0, len(text), 2)], [text[:1], text[1:]]]
    result += [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for seed in range(12):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
        result.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return result


# -- corpus for split invariance ---------------------------------------------------------------

WEATHER_CALL = call_block("get_weather", {"city": "Zürich", "days": 3})
SEARCH_CALL = call_block(
    "search", {"query": "日本 </tool_call> <parameter=x>y</parameter>", "filters": {"z": 1, "a": [True]}}
)
CORPUS: list[tuple[str, dict[str, Any]]] = [
    ("I should check 🙂.\n\nYes.\n</think>\n\nLet me look.\n\n" + WEATHER_CALL, {}),
    ("Two calls\n</think>\n\n" + WEATHER_CALL + "\n" + SEARCH_CALL + "\n", {}),
    ("reasoning that never ends\n</thi", {}),
    ("r\n</think>\n\nAnswer with <tool and <tool_call text.\n\n\nDone <tool_cal", {}),
    ("r\n</think>\n\nBroken: <tool_call>\n<function=get_weather>\n<parameter=city>\nx\n</function>\n", {}),
    ("r\n</think>\n\n" + WEATHER_CALL + "\nAfter the call.", {}),
    ("r\n</think>\n\n" + WEATHER_CALL + "\nAfter the call.", {"tolerant": True}),
    ("r\n</think>\n\nSure.\n<function=search>\n<parameter=query>\nq\n</parameter>\n</function>", {"tolerant": True}),
    ("<tool_call> is literal\n</think>\n\n\n\n" + WEATHER_CALL, {"tools": None}),
    ("No thinking here.\n</think>\n\n" + WEATHER_CALL, {"thinking": False}),
    ("é" * 3 + "\n\n</think>\n\n\n日本語\n\n", {}),
]


@pytest.mark.parametrize("text,options", CORPUS, ids=[f"corpus{i}" for i in range(len(CORPUS))])
def test_any_split_of_the_output_gives_the_same_result(text, options):
    reference, _ = decode([text], **options)
    for pieces in splits(text):
        decoder, _ = decode(pieces, **options)
        assert outcome(decoder) == outcome(reference), pieces


# -- reasoning channel -------------------------------------------------------------------------


def test_reasoning_then_content_drops_only_the_markup():
    decoder, _ = decode(["Think\n\nabout it\n\n\n</think>\n\n\nAnswer\n"])
    assert decoder.reasoning_text == "Think\n\nabout it\n\n"  # one newline before </think> is markup
    assert decoder.content_text == "Answer\n"  # all leading newlines are markup (template lstrips)


def test_reasoning_streams_and_holds_only_a_possible_close():
    decoder = OutputDecoder(True, None, False, THINK_END)
    assert decoder.feed([1], "Hello world") == [ReasoningDelta("Hello world")]
    assert decoder.feed([2], "\n\n") == [ReasoningDelta("\n")]
    assert decoder.feed([3], "</th") == []
    assert decoder.feed([4], "ink") == []
    assert decoder.feed([5], "ing") == [ReasoningDelta("\n</thinking")]
    assert decoder.reasoning_open
    assert decoder.feed([6], "\n</think>\n") == []
    assert not decoder.reasoning_open  # endpoints may close the thinking block before content shows
    assert decoder.feed([7], "\nHi") == [ContentDelta("Hi")]
    assert decoder.finish() == []
    assert decoder.reasoning_text == "Hello world\n\n</thinking"


def test_stream_ending_inside_reasoning_is_all_reasoning():
    decoder, events = decode(["I am still", " thinking\n</thi"])
    assert decoder.reasoning_text == "I am still thinking\n</thi"
    assert decoder.content_text == "" and decoder.tool_calls == ()
    assert events[-1] == ReasoningDelta("\n</thi")


def test_close_without_newline_and_empty_content():
    decoder, events = decode(["done</think>", "\n\n"])
    assert (decoder.reasoning_text, decoder.content_text) == ("done", "")
    assert not any(isinstance(e, ContentDelta) for e in events)


def test_thinking_off_everything_is_content_verbatim():
    text = "\nplain\n</think>\n\nstill content"
    decoder, _ = decode(list(text), thinking=False)
    assert decoder.reasoning_text == "" and decoder.content_text == text
    assert decoder.reasoning_tokens == 0 and not decoder.reasoning_open


def test_tool_markup_inside_reasoning_is_reasoning():
    text = "Maybe " + WEATHER_CALL + "\n</think>\n\nNo call."
    decoder, _ = decode([text])
    assert decoder.reasoning_text == "Maybe " + WEATHER_CALL
    assert decoder.content_text == "No call." and decoder.tool_calls == ()
    assert not decoder.diagnostics.complete_marker_seen


# -- reasoning tokens --------------------------------------------------------------------------


def test_reasoning_tokens_stop_after_the_think_end_token_inside_a_delta():
    decoder = OutputDecoder(True, None, False, THINK_END)
    decoder.feed([1, 2], "a b")
    decoder.feed([3, THINK_END, 5, 6], "\n</think>\n\nHi there")
    decoder.feed([7], "!")
    decoder.finish()
    assert decoder.reasoning_tokens == 4  # 1, 2, 3 and </think>
    assert (decoder.reasoning_text, decoder.content_text) == ("a b", "Hi there!")


def test_reasoning_tokens_follow_ids_when_text_arrives_later():
    decoder = OutputDecoder(True, None, False, THINK_END)
    decoder.feed([1], "x")
    decoder.feed([2, THINK_END], "")  # the engine still holds this text (e.g. a stop-string prefix)
    decoder.feed([4], "\n</think>\n\ny")
    decoder.finish()
    assert decoder.reasoning_tokens == 3
    assert (decoder.reasoning_text, decoder.content_text) == ("x", "y")


def test_reasoning_tokens_without_a_think_end_id_count_the_closing_delta():
    decoder = OutputDecoder(True, None, False, None)
    decoder.feed([1], "abc")
    decoder.feed([2, 3], "\n</think>\n\nHi")
    decoder.feed([4, 5], " there")
    decoder.finish()
    assert decoder.reasoning_tokens == 3


def test_reasoning_only_stream_counts_every_token():
    decoder = OutputDecoder(True, TOOLS, False, THINK_END)
    for token_id in range(10):
        decoder.feed([token_id], "word ")
    decoder.finish()
    assert decoder.reasoning_tokens == 10 and decoder.reasoning_text == "word " * 10


def test_budget_forced_close_guidance_is_reasoning_and_counted():
    decoder = OutputDecoder(True, TOOLS, False, THINK_END)
    events = decoder.feed([1], "I need to consider")
    events += decoder.feed([2, 3], " many options.")
    forced = decoder.feed([10, 11, 12, THINK_END], GUIDANCE + "\n</think>\n\n", forced_token_count=4)
    assert forced == [ReasoningDelta(GUIDANCE)]
    after = decoder.feed([20], "The answer")
    after += decoder.feed([21], " is 4.")
    events += forced + after + decoder.finish()
    check_events(decoder, events)
    assert decoder.reasoning_text == "I need to consider many options." + GUIDANCE
    assert decoder.content_text == "The answer is 4."
    assert decoder.reasoning_tokens == 3 + 4
    assert decoder.forced_tokens == 4


def test_budget_forced_close_followed_by_a_tool_call():
    decoder = OutputDecoder(True, TOOLS, False, THINK_END)
    events = decoder.feed([1], "Thinking")
    events += decoder.feed([10, THINK_END], GUIDANCE + "\n</think>\n\n", forced_token_count=2)
    for token_id, char in enumerate(WEATHER_CALL, start=100):
        events += decoder.feed([token_id], char)
    events += decoder.finish()
    check_events(decoder, events)
    assert decoder.reasoning_tokens == 3
    assert [(c.name, json.loads(c.arguments)) for c in decoder.tool_calls] == [
        ("get_weather", {"city": "Zürich", "days": 3})
    ]


# -- content and tool regions ------------------------------------------------------------------


def test_ordinary_content_streams_immediately_with_tools_enabled():
    decoder = OutputDecoder(False, TOOLS, False, THINK_END)
    assert decoder.feed([1], "Hello") == [ContentDelta("Hello")]
    assert decoder.feed([2], " <tool") == [ContentDelta(" ")]
    assert decoder.feed([3], "box> ok") == [ContentDelta("<toolbox> ok")]
    assert decoder.feed([4], "\n\n") == []  # could be the separator before a call
    assert decoder.feed([5], "More") == [ContentDelta("\n\nMore")]
    assert decoder.feed([6], " <tool_c") == [ContentDelta(" ")]
    assert decoder.finish() == [ContentDelta("<tool_c")]
    assert decoder.content_text == "Hello <toolbox> ok\n\nMore <tool_c"
    assert decoder.diagnostics.complete_marker_seen is False


def test_content_then_tool_calls():
    text = render_turn("Need weather.", "Let me check.", [("get_weather", {"city": "Paris", "days": 2})])
    decoder = OutputDecoder(True, TOOLS, False, THINK_END)
    streamed: list[DecoderEvent] = []
    for token_id, char in enumerate(text):
        streamed += decoder.feed([token_id], char)
    final = decoder.finish()
    check_events(decoder, streamed + final)
    assert "".join(e.text for e in streamed if isinstance(e, ContentDelta)) == "Let me check."  # before finish
    assert not any(isinstance(e, ContentDelta) for e in final)
    assert [type(e) for e in final] == [ToolCallStart, ToolCallArgumentsDelta, ToolCallArgumentsDelta, ToolCallEnd]
    assert final[0] == ToolCallStart(0, "get_weather")
    assert final[-1] == ToolCallEnd(0, '{"city": "Paris", "days": 2}')
    assert decoder.content_text == "Let me check."  # the "\n\n" separator is template markup
    assert decoder.diagnostics.to_dict() == {
        "complete_marker_seen": True,
        "structured_calls": 1,
        "empty_non_string_arguments_omitted": 0,
        "schema_mismatched_arguments_preserved": 0,
        "fallback_reason": "none",
    }


def test_parallel_calls_in_order():
    calls = [("search", {"query": "a", "filters": {"y": 1, "x": 2}}), ("get_weather", {"city": "Rome"}), ("search", {})]
    decoder, events = decode(list(render_turn("r", "", calls)))
    assert [(c.index, c.name, json.loads(c.arguments)) for c in decoder.tool_calls] == [
        (i, name, args) for i, (name, args) in enumerate(calls)
    ]
    assert decoder.tool_calls[0].arguments == '{"query": "a", "filters": {"y": 1, "x": 2}}'
    assert [e.index for e in events if isinstance(e, ToolCallStart)] == [0, 1, 2]
    assert decoder.content_text == ""


REPLAY_CASES = [
    ("Plan.", "", [("get_weather", {"city": "Oslo"})]),
    ("Plan.\n\nStep two.", "Checking now.", [("get_weather", {"city": "Oslo", "days": 4, "metric": False})]),
    ("", "Only text\n\nin two paragraphs.", []),
    ("Multi", "Two:", [("search", {"query": "x\ny", "filters": {"b": [1, None], "a": "s"}}), ("get_weather", {})]),
    (None, "No reasoning.", [("search", {"query": "<parameter=p>v</parameter>"})]),
]


@pytest.mark.parametrize("reasoning,content,calls", REPLAY_CASES)
def test_replaying_the_decoded_turn_renders_the_same_text(reasoning, content, calls):
    text = render_turn(reasoning, content, calls)
    decoder, _ = decode(list(text), thinking=reasoning is not None)
    decoded_calls = [(c.name, json.loads(c.arguments)) for c in decoder.tool_calls]
    assert decoded_calls == [(name, args) for name, args in calls]
    reasoning_out = decoder.reasoning_text if reasoning is not None else None
    assert render_turn(reasoning_out, decoder.content_text, decoded_calls) == text


@pytest.mark.parametrize(
    "region,reason",
    [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nx\n</function>\n</tool_call>", "malformed_structure"),
        (
            call_block("get_weather", {"city": "a"}).replace("</parameter>\n", "</parameter>\n</parameter>\n"),
            "malformed_structure",
        ),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\na\n</parameter>\n<parameter=city>\nb\n</parameter>\n</function>\n</tool_call>",
            "duplicate_parameter",
        ),
        (call_block("get weather", {}), "invalid_tool_name"),
        (call_block("delete_files", {"path": "/"}), "undeclared_tool"),
        (WEATHER_CALL + "\nHope that helps!", "trailing_content"),
        ("<tool_call> is the marker I would use", "malformed_structure"),
    ],
)
def test_fallback_returns_the_whole_region_as_content(region, reason):
    reasoning, content = "Hmm\n", "Here you go:"
    text = reasoning + "\n</think>\n\n" + content + "\n\n" + region
    decoder, events = decode(list(text))
    assert decoder.reasoning_text == reasoning
    assert decoder.content_text == content + "\n\n" + region  # byte for byte, separator included
    assert decoder.tool_calls == ()
    assert not any(isinstance(e, ToolCallStart) for e in events)
    assert decoder.diagnostics.fallback_reason == FallbackReason(reason)
    assert decoder.diagnostics.complete_marker_seen


@pytest.mark.parametrize("tools", [None, {}])
def test_tools_disabled_tool_markup_is_streamed_as_text(tools):
    decoder = OutputDecoder(False, tools, False, THINK_END)
    assert decoder.feed([1], "Hi\n\n<tool_call>\n") == [ContentDelta("Hi\n\n<tool_call>\n")]
    assert decoder.feed([2], WEATHER_CALL[12:]) == [ContentDelta(WEATHER_CALL[12:])]
    assert decoder.finish() == []
    assert decoder.tool_calls == () and decoder.diagnostics.complete_marker_seen is False


def test_tolerant_mode_recovers_calls_and_keeps_trailing_text_as_content():
    text = "r\n</think>\n\nOk.\n\n" + WEATHER_CALL + "\nThat should do it."
    strict, _ = decode(list(text))
    assert strict.tool_calls == () and strict.diagnostics.fallback_reason is FallbackReason.TRAILING_CONTENT
    decoder, events = decode(list(text), tolerant=True)
    assert [c.name for c in decoder.tool_calls] == ["get_weather"]
    assert decoder.content_text == "Ok.\nThat should do it."
    assert isinstance(events[-1], ContentDelta) and events[-1].text == "\nThat should do it."


def test_tolerant_mode_holds_a_wrapperless_function_block():
    decoder = OutputDecoder(False, TOOLS, True, THINK_END)
    assert decoder.feed([1], "Sure.\n<func") == [ContentDelta("Sure.")]
    assert decoder.feed([2], "tion=search>\n<parameter=query>\nq\n</parameter>\n</function>") == []
    final = decoder.finish()
    assert final[0] == ToolCallStart(0, "search") and final[-1] == ToolCallEnd(0, '{"query": "q"}')
    assert decoder.content_text == "Sure."


def test_decoder_rejects_use_after_finish():
    decoder = OutputDecoder(True, TOOLS, False, THINK_END)
    decoder.finish()
    with pytest.raises(RuntimeError):
        decoder.feed([1], "x")
    with pytest.raises(RuntimeError):
        decoder.finish()
