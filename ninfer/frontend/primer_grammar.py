"""primer_grammar: one answer grammar holding the rules that most answer grammars share.

Free text (before tool calls, and in a parameter), JSON strings and spelled-out length minimums
admit most of the vocabulary, so their token masks are the bulk of a compile (about 25 ms each
on a 248K vocabulary) while their rules are the same in every grammar. The engine compiles this
grammar first (engine/compiled_grammars.py), so the library's rule cache already holds those
masks when a request's grammar arrives and that compile computes only what is particular to it.
"""

from __future__ import annotations

from ninfer.frontend.answer_format import AnswerFormat, ToolCalls, ToolSchema
from ninfer.frontend.unrolled_repetitions import MAX_UNROLLED_COPIES

_STRING = {"type": "string"}
_LENGTHS = range(1, MAX_UNROLLED_COPIES + 1)  # the minimums unrolled_repetitions spells out
_JSON_STRINGS = {
    "type": "object",
    "properties": {"text": _STRING, **{f"at_least_{n}": {**_STRING, "minLength": n} for n in _LENGTHS}},
    "required": ["text", *(f"at_least_{n}" for n in _LENGTHS)],
    "additionalProperties": False,
}
PRIMER_TOOL = ToolSchema("primer", {
    "type": "object",
    "properties": {
        "text": _STRING,  # raw text, kept free of the parameter markers
        **{f"line_at_least_{n}": {**_STRING, "minLength": n} for n in _LENGTHS},  # one raw line
        "json": {"type": "array", "items": _JSON_STRINGS},  # strings inside a JSON value
    },
    "required": ["text"],
}, "primer")


def primer_grammar() -> str:
    """The EBNF of text or calls to PRIMER_TOOL (tool_choice auto), as the engine receives answer
    grammars."""
    return AnswerFormat(calls=ToolCalls((PRIMER_TOOL,), required=False)).constraint(None).grammar
