"""unrolled_repetitions: which repetitions it spells out, and that answer grammars with length
minimums allow exactly what the library's own conversion of their structural tag allows: the same
next bytes at every point of strings at, under and over each minimum (escapes, tabs, markers,
multi-byte and broken UTF-8 among them) and of random walks. Matched on a byte vocabulary (257 ids),
so compiling takes milliseconds."""

from __future__ import annotations

import random

import pytest
import xgrammar

from ninfer.frontend.answer_format import AnswerFormat, JsonAnswer, ToolCalls, ToolSchema
from ninfer.frontend.unrolled_repetitions import MAX_UNROLLED_COPIES, unrolled_repetitions
from tests.frontend.test_shared_rules import EOS, WALKS, compiler, matchers, random_walk, same_along  # noqa: F401

# Contents tried in every bounded string: around the minimums, and what a length-bounded value refuses.
CONTENTS = [
    b"", b"a", b"ab", b"abc", b"abcd", "é".encode(), "日本".encode(), "日本語x".encode(), b"\t", b"a\tb",
    b'a\\"b', b"a\\nb", b'"', b"<", b"a<b", b"</parameter>", b"x\ny", b"\r", b"\xff", b"a\xc3", b"\xe6\x97a", b"  ",
]
MINIMUMS = range(0, MAX_UNROLLED_COPIES + 2)  # one past the last spelled-out minimum keeps the counted form


def string(minimum: int, maximum: int | None = None) -> dict:
    return {"type": "string", "minLength": minimum, **({} if maximum is None else {"maxLength": maximum})}


def bounds() -> list[tuple[int, int | None]]:
    return [(low, None) for low in MINIMUMS] + [(1, 3), (2, 2)]


def test_short_open_ended_repetitions_of_one_class_are_spelled_out() -> None:
    ebnf = (
        'root ::= (("\\"" chars{1, -1} "\\"" chars{2, -1} line{0, -1} chars{3, -1} chars{0, 4} items{1, -1}))\n'
        "chars ::= (([^\\\"\\\\\\r\\n]))\n"
        'line ::= (([^<\\n\\r]))\n'
        'items ::= (("," chars))\n'
        'ahead ::= (([a-z])) (=("x"))\n'
        'other ::= (("ahead{1, -1} [x]{1, -1}" ahead{1, -1}))\n'
    )
    rewritten = unrolled_repetitions(ebnf)
    assert rewritten.splitlines()[0] == (
        'root ::= (("\\"" ([^\\"\\\\\\r\\n] [^\\"\\\\\\r\\n]*) "\\"" '
        '([^\\"\\\\\\r\\n] [^\\"\\\\\\r\\n] [^\\"\\\\\\r\\n]*) '
        "([^<\\n\\r]*) chars{3, -1} chars{0, 4} items{1, -1}))"
    )
    # A rule with a lookahead is not a bare class; literals keep their text.
    assert rewritten.splitlines()[5] == ebnf.splitlines()[5]
    assert xgrammar.Grammar.from_ebnf(rewritten)


def test_a_grammar_without_such_repetitions_is_unchanged() -> None:
    ebnf = 'root ::= (("a" b{0, 3} c{1, -1}))\nb ::= (([0-9]))\nc ::= (("x" | "y"))\n'
    assert unrolled_repetitions(ebnf) == ebnf


@pytest.mark.parametrize("low, high", bounds())
def test_json_strings_with_length_bounds_match_the_reference(compiler, low, high) -> None:
    schema = {"type": "object", "required": ["s", "t"], "additionalProperties": False,
              "properties": {"s": string(low, high), "t": {"type": "array", "items": string(low, high)}}}
    answer = AnswerFormat(json=JsonAnswer(schema, "response_format"))
    for content in CONTENTS:
        same_along(matchers(compiler, answer), [*b'{"s": "', *content, *b'", "t": []}', EOS])
        same_along(matchers(compiler, answer), [*b'{"s": "x", "t": ["', *content, *b'", "', *content, *b'"]}', EOS])
    rng = random.Random(low)
    for _ in range(WALKS):
        random_walk(matchers(compiler, answer), rng)


@pytest.mark.parametrize("low, high", bounds())
@pytest.mark.parametrize("required", [True, False])
def test_tool_parameters_with_length_bounds_match_the_reference(compiler, low, high, required) -> None:
    tool = ToolSchema("t", {
        "type": "object",
        "properties": {"line": string(low, high), "json": {"type": "array", "items": string(low, high)}},
        "required": ["line"],
    }, "tools[0].function.parameters")
    answer = AnswerFormat(calls=ToolCalls((tool,), required=required))
    head = b"<tool_call>\n<function=t>\n<parameter=line>\n"
    tail = b"\n</parameter>\n</function>\n</tool_call>"
    for content in CONTENTS:
        same_along(matchers(compiler, answer), [*head, *content, *tail, EOS])
        json_value = b'\n</parameter>\n<parameter=json>\n["' + content + b'"]'
        same_along(matchers(compiler, answer), [*head, *b"line", *json_value, *tail, EOS])
        same_along(matchers(compiler, answer, thinking=True), [*b"\n\n", *head, *content, *tail, EOS])
    rng = random.Random(10 * low + required)
    for _ in range(WALKS):
        random_walk(matchers(compiler, answer), rng)
