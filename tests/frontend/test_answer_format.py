"""AnswerFormat's grammars against the chat template that renders tool calls and the parser that
reads them: what the template writes, the grammar accepts and the parser reads back unchanged;
what the parser could not read (undeclared or missing parameters, markers inside a value, text
after the calls), the grammar refuses. Matched on a byte vocabulary, so compiling takes
milliseconds."""

from __future__ import annotations

import json

import pytest
import xgrammar

from ninfer.assets import chat_template_source
from ninfer.frontend.answer_format import AnswerFormat, AnswerFormatError, JsonAnswer, ToolCalls, ToolSchema
from ninfer.frontend.grammar_vocabulary import GrammarVocabulary
from ninfer.frontend.template import ChatTemplate
from ninfer.frontend.tool_call_parser import ToolCallParser
from tests.unit.conftest import make_byte_tokenizer

WEATHER = ToolSchema("get_weather", {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "options": {"type": "object", "properties": {"hourly": {"type": "boolean"}}, "required": ["hourly"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
}, "tools[0].function.parameters")
NOOP = ToolSchema("noop", None, "tools[1].function.parameters")


@pytest.fixture(scope="module")
def compiler() -> xgrammar.GrammarCompiler:
    return xgrammar.GrammarCompiler(GrammarVocabulary(make_byte_tokenizer(), 257).info, max_threads=1)


def accepts(compiler, answer: AnswerFormat, text: str, thinking: bool = False) -> bool:
    constraint = answer.constraint(256 if thinking else None)
    matcher = xgrammar.GrammarMatcher(compiler.compile_grammar(constraint.grammar), override_stop_tokens=[256])
    return matcher.accept_string(text) and matcher.accept_token(256)


def rendered_calls(calls: list[tuple[str, dict]]) -> str:
    """The answer part of an assistant turn with these calls, as the Qwen 3.5 template writes it."""
    template = ChatTemplate(chat_template_source("qwen3_5"))
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": arguments}} for name, arguments in calls
        ]},
    ]
    text = template.render(messages, add_generation_prompt=False)
    return text.rsplit("</think>\n\n", 1)[1].removesuffix("<|im_end|>\n")


CALLS = [
    [("get_weather", {"city": "Paris\nFrance", "days": 3})],
    [("get_weather", {"city": "", "days": 1, "unit": "celsius", "options": {"hourly": True}, "tags": ["a", "b c"],
                      "limit": 7, "metric": False})],
    [("get_weather", {"city": "Oslo", "days": 2, "limit": 5}), ("noop", {})],
]


@pytest.mark.parametrize("calls", CALLS)
def test_what_the_template_writes_the_grammar_accepts_and_the_parser_reads_back(compiler, calls) -> None:
    text = rendered_calls(calls)
    required = AnswerFormat(calls=ToolCalls((WEATHER, NOOP), required=True))
    assert accepts(compiler, required, text)
    assert accepts(compiler, required, "\n\n" + text, thinking=True)
    assert not accepts(compiler, required, text, thinking=True)  # a thinking answer opens with the blank line
    auto = AnswerFormat(calls=ToolCalls((WEATHER, NOOP), required=False))
    assert accepts(compiler, auto, "Let me check.\n\n" + text) and accepts(compiler, auto, "No call needed.")
    parsed = ToolCallParser({"get_weather": WEATHER.parameters, "noop": None}).parse(text)
    assert parsed.structured
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == calls


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",  # no city
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nx\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "<parameter=color>\nred\n</parameter>\n</function>\n</tool_call>",  # undeclared
        "<tool_call>\n<function=get_weather>\n<parameter=city>\na <parameter=x> b\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n</tool_call>",  # a nested opener the parser would balance
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nx\n</parameter>\n<parameter=days>\nthree\n</parameter>\n"
        "</function>\n</tool_call>",  # not an integer
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n<parameter=city>\nx\n</parameter>\n"
        "</function>\n</tool_call>",  # out of declared order
        "<tool_call>\n<function=search>\n</function>\n</tool_call>",  # not a callable tool
    ],
)
def test_what_the_parser_could_not_read_back_the_grammar_refuses(compiler, text) -> None:
    assert not accepts(compiler, AnswerFormat(calls=ToolCalls((WEATHER, NOOP), required=True)), text)


def test_named_and_single_call_turns(compiler) -> None:
    one, two = rendered_calls(CALLS[0]), rendered_calls(CALLS[2])
    single = AnswerFormat(calls=ToolCalls((WEATHER, NOOP), required=True, parallel=False))
    assert accepts(compiler, single, one) and not accepts(compiler, single, two)
    named = AnswerFormat(calls=ToolCalls((NOOP,), required=True, parallel=False))
    assert accepts(compiler, named, rendered_calls([("noop", {})])) and not accepts(compiler, named, one)
    auto_single = AnswerFormat(calls=ToolCalls((WEATHER, NOOP), required=False, parallel=False))
    assert accepts(compiler, auto_single, "Sure.\n\n" + one) and not accepts(compiler, auto_single, one + "\nmore")


def test_json_answers(compiler) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    answer = AnswerFormat(json=JsonAnswer(schema, "response_format.json_schema.schema"))
    assert accepts(compiler, answer, '{"a": 1}') and accepts(compiler, answer, '{"a":1}')
    assert not accepts(compiler, answer, '{"a":  1}') and not accepts(compiler, answer, '{"a": 1, "b": 2}')
    json_mode = AnswerFormat(json=JsonAnswer({"type": "object"}, "response_format"))
    assert accepts(compiler, json_mode, '{"x": [1, {"y": null}]}') and not accepts(compiler, json_mode, "[1]")
    either = AnswerFormat(json=JsonAnswer(schema, "response_format"), calls=ToolCalls((NOOP,), required=False))
    assert accepts(compiler, either, '{"a": 2}') and accepts(compiler, either, rendered_calls([("noop", {})]))
    assert not accepts(compiler, either, "plain text")


@pytest.mark.parametrize(
    "answer, path",
    [
        (AnswerFormat(json=JsonAnswer({"$ref": "#/nope"}, "response_format.json_schema.schema")),
         "response_format.json_schema.schema"),
        (AnswerFormat(calls=ToolCalls((WEATHER, ToolSchema("odd", {"properties": {"a\nb": {}}}, "tools[1].p")), True)),
         "tools[1].p.properties"),
        (AnswerFormat(calls=ToolCalls((ToolSchema("x", {"properties": {"n": {"$ref": "#/missing"}}}, "tools[0].p"),),
                                      True)), "tools[0].p"),
        (AnswerFormat(calls=ToolCalls((ToolSchema("x", {"properties": {"e": {"type": "string", "enum": [1]}}},
                                                  "tools[0].p"),), True)), "tools[0].p.properties.e"),
        (AnswerFormat(calls=ToolCalls((ToolSchema("x", {"$ref": "#/$defs/Missing"}, "tools[0].p"),), True)),
         "tools[0].p.$ref"),
    ],
)
def test_a_schema_the_grammar_cannot_hold_names_its_field(answer, path) -> None:
    with pytest.raises(AnswerFormatError) as error:
        answer.constraint(None)
    assert error.value.path == path


def test_pydantic_schemas_resolve_their_definitions(compiler) -> None:
    parameters = {
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                            "additionalProperties": False}},
        "$ref": "#/$defs/Args",
    }
    parameters["$defs"]["Args"] = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}},
                                   "required": ["at"], "additionalProperties": False}
    tool = ToolSchema("place", parameters, "tools[0].function.parameters")
    text = rendered_calls([("place", {"at": {"x": 4}})])
    assert accepts(compiler, AnswerFormat(calls=ToolCalls((tool,), required=True)), text)


def test_equal_grammars_share_a_key() -> None:
    first = AnswerFormat(calls=ToolCalls((WEATHER,), required=True)).constraint(None)
    assert first.key == AnswerFormat(calls=ToolCalls((WEATHER,), required=True)).constraint(None).key
    assert first.key != AnswerFormat(calls=ToolCalls((WEATHER,), required=True)).constraint(7).key
    assert first.starts_after_token_id is None
