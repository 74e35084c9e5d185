"""ToolCallParser: Qwen XML structure, schema-guided argument typing, fallback reasons, tolerant mode."""

from __future__ import annotations

import json

import pytest

from ninfer.frontend.tool_call_parser import (
    FallbackReason,
    ToolCallParse,
    ToolCallParser,
    declared_types,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
    },
}


def block(name: str, *params: tuple[str, str]) -> str:
    """A call rendered the way the Qwen template writes one."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parse(region: str, tools: dict | None = None, tolerant: bool = False) -> ToolCallParse:
    return ToolCallParser({"get_weather": WEATHER} if tools is None else tools, tolerant).parse(region)


def args(result: ToolCallParse, index: int = 0) -> dict:
    assert result.structured, result.fallback_reason
    return json.loads(result.calls[index].arguments)


def typed(param_schema: dict | None, value: str) -> ToolCallParse:
    """One call of tool `f` whose only parameter `p` has `param_schema` and text `value`."""
    properties = {} if param_schema is None else {"p": param_schema}
    return parse(block("f", ("p", value)), {"f": {"type": "object", "properties": properties}})


# -- structure ---------------------------------------------------------------------------------


def test_single_call_keeps_parameter_order_and_json_layout():
    result = parse(block("get_weather", ("metric", "true"), ("city", "Paris"), ("days", "3")))
    assert result.structured
    (call,) = result.calls
    assert (call.index, call.name) == (0, "get_weather")
    assert call.arguments == '{"metric": true, "city": "Paris", "days": 3}'
    assert list(json.loads(call.arguments)) == ["metric", "city", "days"]
    assert "".join(call.argument_pieces()) == call.arguments
    diagnostics = result.diagnostics
    assert diagnostics.complete_marker_seen and diagnostics.structured_calls == 1
    assert diagnostics.fallback_reason is FallbackReason.NONE


def test_call_without_parameters_has_empty_object():
    result = parse("<tool_call>\n<function=get_weather>\n</function>\n</tool_call>")
    assert result.calls[0].arguments == "{}"
    assert result.calls[0].argument_pieces() == ["{}"]


def test_value_framing_removes_exactly_one_newline_each_side():
    assert args(parse(block("get_weather", ("city", "\nParis\n"))))["city"] == "\nParis\n"
    tight = "<tool_call><function=get_weather><parameter=city>Paris</parameter></function></tool_call>"
    assert args(parse(tight))["city"] == "Paris"
    multi = block("get_weather", ("city", "line one\n  line two\n\nline four"))
    assert args(parse(multi))["city"] == "line one\n  line two\n\nline four"


def test_parallel_calls_are_indexed_in_order_with_whitespace_between_and_after():
    region = block("get_weather", ("city", "Paris")) + "\n" + block("lookup", ("q", "x")) + " \n\n"
    result = parse(region, {"get_weather": WEATHER, "lookup": None})
    assert [(c.index, c.name) for c in result.calls] == [(0, "get_weather"), (1, "lookup")]
    assert result.diagnostics.structured_calls == 2
    assert result.trailing_text == ""


def test_non_ascii_values_are_not_escaped():
    result = parse(block("get_weather", ("city", "Zürich 日本 🙂")))
    assert result.calls[0].arguments == '{"city": "Zürich 日本 🙂"}'


def test_string_values_keep_tool_markers_and_balanced_nested_parameters():
    value = (
        "see <parameter=inner>\nnested\n</parameter> and\n"
        "<parameter=a><parameter=b>x</parameter></parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=evil>"
    )
    assert args(parse(block("get_weather", ("city", value), ("days", "2")))) == {"city": value, "days": 2}


def test_bare_parameter_opener_without_header_is_value_text():
    value = 's = "<parameter=" + name'
    assert args(parse(block("get_weather", ("city", value))))["city"] == value


# -- typing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schema,types",
    [
        ({"type": "integer"}, {"integer"}),
        ({"type": ["integer", "null"]}, {"integer", "null"}),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, {"string", "integer"}),
        ({"oneOf": [{"type": "number"}, {"type": ["boolean", "null"]}]}, {"number", "boolean", "null"}),
        ({"type": "object", "properties": {"x": {}}}, {"object"}),
        ({"anyOf": [{"type": "integer"}, {"$ref": "#/defs/x"}]}, None),
        ({"anyOf": [{"type": "integer"}, {"type": "file"}]}, None),
        ({"anyOf": []}, None),
        ({"type": "file"}, None),
        ({"enum": ["a", "b"]}, None),
        ({}, None),
        (None, None),
    ],
)
def test_declared_types(schema, types):
    assert declared_types(schema) == (None if types is None else frozenset(types))


@pytest.mark.parametrize(
    "schema,text,value",
    [
        ({"type": "string"}, "123", "123"),
        ({"type": "string"}, "true", "true"),
        ({"type": "string"}, "", ""),
        ({"type": "string"}, '{"a": 1}', '{"a": 1}'),
        ({"type": "integer"}, "42", 42),
        ({"type": "integer"}, " 42 ", 42),
        ({"type": "integer"}, "7.0", 7.0),
        ({"type": "number"}, "2.5", 2.5),
        ({"type": "number"}, "3", 3),
        ({"type": "boolean"}, "true", True),
        ({"type": "boolean"}, "True", True),
        ({"type": "boolean"}, " FALSE ", False),
        ({"type": "null"}, "null", None),
        ({"type": "object"}, '{"z": 1, "a": [2]}', {"z": 1, "a": [2]}),
        ({"type": "array"}, '[1, "two"]', [1, "two"]),
        ({"type": ["integer", "null"]}, "null", None),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "5", "5"),
        ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "7", 7),
        ({"oneOf": [{"type": "number"}, {"type": "boolean"}]}, "TRUE", True),
    ],
)
def test_admitted_values_keep_their_type(schema, text, value):
    result = typed(schema, text)
    got = args(result)["p"]
    assert got == value and type(got) is type(value)
    assert result.diagnostics.schema_mismatched_arguments_preserved == 0
    assert result.diagnostics.empty_non_string_arguments_omitted == 0


@pytest.mark.parametrize(
    "schema,text,value",
    [
        ({"type": "integer"}, "5.5", 5.5),  # valid JSON keeps its represented type
        ({"type": "integer"}, '"5"', "5"),
        ({"type": "integer"}, "true", True),
        ({"type": "integer"}, "True", "True"),  # boolean text only normalizes where booleans are admitted
        ({"type": "boolean"}, "yes", "yes"),
        ({"type": "object"}, "{a: 1}", "{a: 1}"),
        ({"type": "array"}, '{"a": 1}', {"a": 1}),
        ({"type": "number"}, "NaN", "NaN"),  # not JSON: re-serializing would produce invalid JSON
        ({"type": "number"}, "1e999", "1e999"),
        ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "none", "none"),
    ],
)
def test_nonempty_mismatch_stays_a_structured_call_and_is_counted(schema, text, value):
    result = typed(schema, text)
    got = args(result)["p"]
    assert got == value and type(got) is type(value)
    assert result.diagnostics.schema_mismatched_arguments_preserved == 1


@pytest.mark.parametrize("text", ["", "   ", "\n"])
@pytest.mark.parametrize(
    "schema", [{"type": "integer"}, {"type": "object"}, {"anyOf": [{"type": "boolean"}, {"type": "null"}]}]
)
def test_empty_block_of_declared_non_string_parameter_is_omitted(schema, text):
    result = typed(schema, text)
    assert args(result) == {}
    assert result.diagnostics.empty_non_string_arguments_omitted == 1
    assert result.diagnostics.structured_calls == 1


def test_empty_block_exactly_as_the_template_writes_it():
    region = "<tool_call>\n<function=get_weather>\n<parameter=days>\n\n</parameter>\n<parameter=city>\n\n</parameter>\n</function>\n</tool_call>"
    result = parse(region)
    assert args(result) == {"city": ""}
    assert result.diagnostics.empty_non_string_arguments_omitted == 1


@pytest.mark.parametrize(
    "schema",
    [None, {}, {"description": "no type"}, {"type": "file"}, {"anyOf": [{"type": "integer"}, {"enum": [1]}]}],
)
@pytest.mark.parametrize(
    "text,value",
    [
        ("12", 12),
        ("1.5", 1.5),
        ("true", True),
        ("True", "True"),
        ("null", None),
        ('"quoted"', "quoted"),
        ('{"z": 1, "a": 2}', {"z": 1, "a": 2}),
        ("plain text", "plain text"),
        ("", ""),
        ("NaN", "NaN"),
    ],
)
def test_untyped_inference_is_json_when_it_parses_else_string(schema, text, value):
    result = typed(schema, text)
    got = args(result)["p"]
    assert got == value and type(got) is type(value)
    assert result.diagnostics.schema_mismatched_arguments_preserved == 0
    assert result.diagnostics.empty_non_string_arguments_omitted == 0


def test_untyped_nested_json_keeps_member_order():
    result = typed(None, '{"zeta": {"b": 1, "a": 2}, "alpha": [3]}')
    assert result.calls[0].arguments == '{"p": {"zeta": {"b": 1, "a": 2}, "alpha": [3]}}'


def test_tool_without_schema_and_undeclared_parameter_are_untyped():
    assert args(parse(block("lookup", ("n", "5")), {"lookup": None})) == {"n": 5}
    assert args(parse(block("get_weather", ("extra", "[1]"), ("days", "2")))) == {"extra": [1], "days": 2}


def test_counters_sum_over_parallel_calls():
    region = block("get_weather", ("days", ""), ("metric", "maybe")) + "\n" + block("get_weather", ("days", "x"))
    result = parse(region)
    assert result.diagnostics.structured_calls == 2
    assert result.diagnostics.empty_non_string_arguments_omitted == 1
    assert result.diagnostics.schema_mismatched_arguments_preserved == 2
    assert [json.loads(c.arguments) for c in result.calls] == [{"metric": "maybe"}, {"days": "x"}]


# -- fallbacks ---------------------------------------------------------------------------------

GOOD = block("get_weather", ("city", "Paris"))


@pytest.mark.parametrize(
    "region",
    [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n",  # unclosed
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",  # no </function>
        "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",  # no function
        "<tool_call>\n<function=get_weather\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",  # unclosed value
        "<tool_call>\n<function=get_weather>\nhello\n</function>\n</tool_call>",  # stray text
        "<tool_call>\n<function=get_weather>\n<parameter=>\nx\n</parameter>\n</function>\n</tool_call>",
        GOOD + "\nI will now wait.\n" + GOOD,  # text between blocks
        GOOD + "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRo",  # cut-off second call
        "<tool_call>",
        "<function=get_weather>\n</function>",  # wrapper missing (strict mode)
    ],
)
def test_malformed_structure_falls_back(region):
    result = parse(region)
    assert result.fallback_reason is FallbackReason.MALFORMED_STRUCTURE
    assert result.calls == () and not result.structured


def test_unmatched_nested_parameter_opener_falls_back():
    value = "text <parameter=inner>\nnever closed"
    assert parse(block("get_weather", ("city", value))).fallback_reason is FallbackReason.MALFORMED_STRUCTURE


def test_standalone_parameter_close_falls_back():
    region = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</parameter>\n</function>\n</tool_call>"
    assert parse(region).fallback_reason is FallbackReason.MALFORMED_STRUCTURE
    leading = "<tool_call>\n<function=get_weather>\n</parameter>\n</function>\n</tool_call>"
    assert parse(leading).fallback_reason is FallbackReason.MALFORMED_STRUCTURE


def test_duplicate_parameter_falls_back():
    result = parse(block("get_weather", ("city", "Paris"), ("days", "1"), ("city", "Rome")))
    assert result.fallback_reason is FallbackReason.DUPLICATE_PARAMETER


@pytest.mark.parametrize("name", ["", "get weather", "get_weather()", "名前", "-x"])
def test_implausible_tool_name_falls_back(name):
    assert parse(block(name, ("city", "Paris"))).fallback_reason is FallbackReason.INVALID_TOOL_NAME


def test_declared_name_is_accepted_even_if_unusual():
    assert parse(block("get weather", ("q", "1")), {"get weather": None}).structured


@pytest.mark.parametrize("name", ["search", "ns.search", "Get_Weather"])
def test_undeclared_tool_falls_back(name):
    assert parse(block(name, ("q", "x"))).fallback_reason is FallbackReason.UNDECLARED_TOOL


def test_any_bad_call_sends_every_call_back():
    region = GOOD + "\n" + block("search", ("q", "x"))
    result = parse(region)
    assert result.fallback_reason is FallbackReason.UNDECLARED_TOOL and result.calls == ()


def test_trailing_content_falls_back():
    assert parse(GOOD + "\nDone!").fallback_reason is FallbackReason.TRAILING_CONTENT
    assert parse(GOOD + "<tool_call>" + "x").fallback_reason is FallbackReason.MALFORMED_STRUCTURE


def test_fallback_diagnostics_count_no_arguments():
    result = parse(block("get_weather", ("days", ""), ("days", "")))
    assert result.diagnostics.to_dict() == {
        "complete_marker_seen": True,
        "structured_calls": 0,
        "empty_non_string_arguments_omitted": 0,
        "schema_mismatched_arguments_preserved": 0,
        "fallback_reason": "duplicate_parameter",
    }


# -- tolerant mode -----------------------------------------------------------------------------


def test_tolerant_recovers_a_call_without_wrapper():
    region = "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>"
    result = parse(region, tolerant=True)
    assert args(result) == {"city": "Paris"} and result.trailing_text == ""


def test_tolerant_recovers_an_unclosed_wrapper_and_mixed_wrappers():
    unclosed = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
    assert args(parse(unclosed, tolerant=True)) == {"city": "Paris"}
    mixed = unclosed + "<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    result = parse(mixed, tolerant=True)
    assert [json.loads(c.arguments) for c in result.calls] == [{"city": "Paris"}, {"days": 2}]
    assert [c.index for c in result.calls] == [0, 1]


def test_tolerant_keeps_trailing_text_as_content():
    result = parse(GOOD + "\nI called the tool.", tolerant=True)
    assert result.structured and len(result.calls) == 1
    assert result.trailing_text == "\nI called the tool."
    cut = GOOD + "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRo"
    result = parse(cut, tolerant=True)
    assert (
        len(result.calls) == 1 and result.trailing_text == "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRo"
    )


def test_tolerant_still_falls_back_without_a_complete_call_or_on_bad_identity():
    assert parse("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa", tolerant=True).fallback_reason is (
        FallbackReason.MALFORMED_STRUCTURE
    )
    assert parse("<function=get_weather> is how you call it", tolerant=True).fallback_reason is (
        FallbackReason.MALFORMED_STRUCTURE
    )
    undeclared = "<function=search>\n</function>\nthen text"
    assert parse(undeclared, tolerant=True).fallback_reason is FallbackReason.UNDECLARED_TOOL


def test_tolerant_mode_does_not_change_well_formed_results():
    region = GOOD + "\n" + block("get_weather", ("days", "4"))
    assert parse(region, tolerant=True) == parse(region)
