"""AnswerFormat: what a structured-output request's answer must be, as a grammar.

A JSON answer (Chat `response_format`, Responses `text.format`) is one JSON value of its schema.
Constrained tool calls (`tool_choice` required or named, Anthropic `any` / `tool`, `strict`
function tools) are spelled exactly as the Qwen 3.5+ templates render them and as
`tool_call_parser` reads them back:

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

with parallel calls joined by one newline. Parameters follow the schema's declared order; the
required ones always appear, optional ones may, undeclared ones never (a tool without declared
properties takes no arguments, as an omitted OpenAI parameter list means). A value is raw text
where the parser keeps text (a parameter whose declared types include string), else compact JSON
of the parameter's schema, which the parser loads back (a boolean also as the templates print
it, `True`). A raw text value can never spell `<parameter=` or `</parameter>` (the format has no
escape), so it always parses back whole; one with length bounds is a single line without `<`.
Two places are matched as given: a string `pattern`, and strings nested inside a JSON value
(keeping the markers out of those costs the grammar library most of a second per compile).

The grammar is written in xgrammar's structural-tag format (plain JSON, `structural_tag`, the
reference construction). The API process has the library convert it to EBNF (milliseconds; a
schema the library rejects is a 400 naming its field), spells out short length minimums (frontend/
unrolled_repetitions.py: masks the library's rule cache can keep across grammars) and merges its
equal rules (frontend/shared_rules.py: every JSON-valued parameter otherwise brings its own copy
of the JSON string rules, and compiling walks the vocabulary once per copy); the engine compiles
that EBNF against the vocabulary. Raw-string `format` keywords are not enforced (JSON Schema
treats them as annotations).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ninfer.contract.constraint import OutputConstraint
from ninfer.frontend.grammar_library import grammar_library
from ninfer.frontend.shared_rules import shared_rules
from ninfer.frontend.tool_call_parser import (
    FUNCTION_CLOSE,
    FUNCTION_OPEN,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    declared_types,
)
from ninfer.frontend.unrolled_repetitions import unrolled_repetitions

# Inside a value these would open or close a parameter to the parser.
VALUE_EXCLUDES = (PARAMETER_OPEN, PARAMETER_CLOSE)
# Whitespace the JSON of an answer or a value may put between tokens: none, or one character
# (`{"a": 1}` as the templates' tojson writes it), so a model cannot pad forever.
MAX_JSON_WHITESPACE = 1
# After </think> the templates write a blank line before the answer.
THINKING_ANSWER_PREFIX = "\n\n"
_LENGTH_KEYWORDS = ("minLength", "maxLength")
CHECKED_GRAMMARS = 256  # distinct grammars whose check the API process remembers
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # the library's time and source location
_DEFINITION_KEYWORDS = ("$defs", "definitions")


class AnswerFormatError(ValueError):
    """A schema the grammar cannot represent; `path` is the request field that holds it."""

    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class JsonAnswer:
    schema: dict[str, Any]  # {"type": "object"} for JSON mode
    path: str  # the request field that holds it (errors name it)


@dataclass(frozen=True)
class ToolSchema:
    name: str  # the tool's name as the prompt renders it
    parameters: dict[str, Any] | None
    path: str  # the request field of its parameters schema


@dataclass(frozen=True)
class ToolCalls:
    tools: tuple[ToolSchema, ...]  # the calls the grammar spells (the callable set, or the named tool)
    required: bool  # the answer is calls only, at least one
    parallel: bool = True  # more than one call


@dataclass(frozen=True)
class AnswerFormat:
    json: JsonAnswer | None = None
    calls: ToolCalls | None = None

    @property
    def kind(self) -> str:
        """Its label in the request log."""
        if self.calls is None:
            return "json"
        if self.calls.required:
            return "tool_calls"
        return "strict_tool_calls" if self.json is None else "json_or_tool_calls"

    def constraint(self, think_end_token_id: int | None) -> OutputConstraint:
        """The engine's constraint; think_end_token_id: set for a thinking request (the answer
        follows that token). Raises AnswerFormatError naming the field of a schema the grammar
        cannot represent or the library rejects."""
        tag = canonical_json(self.structural_tag(think_end_token_id is not None))
        try:
            key, grammar = _checked_grammar(tag)
        except (RuntimeError, ValueError) as error:
            raise self._locate(error) from None
        return OutputConstraint(key, grammar, think_end_token_id)

    def structural_tag(self, thinking: bool) -> dict[str, Any]:
        """The grammar of the answer; thinking: it follows </think> (the blank line comes first).
        Raises AnswerFormatError for a schema or tool that cannot be spelled."""
        answer = self._answer()
        if thinking:
            answer = _sequence([_const(THINKING_ANSWER_PREFIX), answer])
        return {"type": "structural_tag", "format": answer}

    def parts(self) -> list[tuple[str, dict[str, Any]]]:
        """(request field, grammar) of each schema on its own, to find which one fails to compile."""
        parts = []
        if self.json is not None:
            parts.append((self.json.path, _tag(json_value(self.json.schema))))
        for tool in self.calls.tools if self.calls is not None else ():
            parts.append((tool.path, _tag(tool_call(tool))))
        return parts

    def _locate(self, error: Exception) -> AnswerFormatError:
        """The first field, in request order, whose schema fails on its own."""
        for path, part in self.parts():
            try:
                grammar_library().Grammar.from_structural_tag(canonical_json(part))
            except (RuntimeError, ValueError) as part_error:
                return AnswerFormatError(path, f"{path} cannot be compiled into a grammar: {_reason(part_error)}")
        path = self.json.path if self.json is not None else "tools"
        return AnswerFormatError(path, f"{path} cannot be compiled into a grammar: {_reason(error)}")

    def _answer(self) -> dict[str, Any]:
        calls = self.calls
        if calls is None:
            assert self.json is not None
            return json_value(self.json.schema)
        if not calls.tools:
            raise AnswerFormatError("tools", "a tool call is required but no tool can be called")
        bodies = [tool_call(tool) for tool in calls.tools]
        if calls.required:
            return _calls(bodies, calls.parallel)
        if self.json is not None:
            return {"type": "or", "elements": [json_value(self.json.schema), _calls(bodies, calls.parallel)]}
        # Free text, then optionally the calls, with nothing after them (the parser's rule). The text
        # cannot hold `<tool_call>`, so the calls start at its first one. This rule refers to no tool,
        # so its masks are the same for every tool set (the library's trigger form embeds the calls).
        text = {"type": "any_text", "excludes": [TOOL_CALL_OPEN]}
        return {"type": "or", "elements": [text, _sequence([text, _calls(bodies, calls.parallel)])]}


def tool_call(tool: ToolSchema) -> dict[str, Any]:
    """One complete `<tool_call>` block of `tool` with arguments valid for its schema."""
    if not tool.name or any(c in tool.name for c in "<>\n"):
        raise AnswerFormatError(tool.path, f"the tool name {tool.name!r} cannot be written in a Qwen tool call")
    parameters = _resolve_root(tool.parameters, tool.path)
    elements: list[dict[str, Any]] = []
    properties = parameters.get("properties") or {}
    required = parameters.get("required") or []
    if not isinstance(properties, Mapping):
        raise AnswerFormatError(f"{tool.path}.properties", "properties must be an object")
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        raise AnswerFormatError(f"{tool.path}.required", "required must be an array of parameter names")
    definitions = {k: parameters[k] for k in _DEFINITION_KEYWORDS if k in parameters}
    names = list(properties) + [name for name in required if name not in properties]
    for name in names:
        if not isinstance(name, str) or not name or any(c in name for c in "<>\n"):
            raise AnswerFormatError(
                f"{tool.path}.properties", f"the parameter name {name!r} cannot be written in a Qwen tool call"
            )
        schema = properties.get(name, {})
        if not isinstance(schema, (Mapping, bool)):
            raise AnswerFormatError(f"{tool.path}.properties.{name}", "a parameter schema must be an object")
        parameter = _parameter(name, schema, definitions, f"{tool.path}.properties.{name}")
        elements.append(parameter if name in required else {"type": "optional", "content": parameter})
    return {"type": "sequence", "elements": [
        _const(f"{TOOL_CALL_OPEN}\n"),
        _const(f"{FUNCTION_OPEN}{tool.name}>\n"),
        *elements,
        _const(f"{FUNCTION_CLOSE}\n"),
        _const(TOOL_CALL_CLOSE),
    ]}


def json_value(schema: Any) -> dict[str, Any]:
    """A JSON value of `schema`."""
    return {"type": "json_schema", "json_schema": schema, "style": "json", "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _parameter(name: str, schema: Mapping[str, Any] | bool, definitions: dict[str, Any], path: str) -> dict[str, Any]:
    """`<parameter=NAME>`, the value between the template's framing newlines, `</parameter>`."""
    begin, end = f"{PARAMETER_OPEN}{name}>\n", f"\n{PARAMETER_CLOSE}\n"
    types = declared_types(schema) if isinstance(schema, Mapping) else None
    if types is not None and "string" in types:
        branch = _string_branch(schema)
        if "enum" not in branch and "const" not in branch and "pattern" not in branch and (
            branch.get("minLength") or branch.get("maxLength") is not None
        ):
            return _sequence([_const(begin), _bounded_line(branch, end, path)])
    return {"type": "tag", "begin": begin, "content": _parameter_value(schema, definitions, path), "end": end}


def _parameter_value(schema: Mapping[str, Any] | bool, definitions: dict[str, Any], path: str) -> dict[str, Any]:
    types = declared_types(schema) if isinstance(schema, Mapping) else None
    if types is not None and "string" in types:
        return _raw_string(_string_branch(schema), path)
    if types == {"boolean"} and not {"enum", "const"} & set(schema):
        # The templates write a boolean argument as Python prints it; the parser reads either case.
        return {"type": "or", "elements": [_const(word) for word in ("true", "false", "True", "False")]}
    full = {**definitions, **schema} if isinstance(schema, Mapping) else schema
    return json_value(full)


def _string_branch(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """The keywords a raw text value is checked against: the schema's own, or its first anyOf /
    oneOf branch that admits strings."""
    if "string" in (declared_types({"type": schema.get("type")}) or ()):
        return schema
    for keyword in ("anyOf", "oneOf"):
        for branch in schema.get(keyword) or ():
            if isinstance(branch, Mapping) and "string" in (declared_types(branch) or ()):
                return branch
    return schema


def _raw_string(schema: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Text between the parameter's framing newlines, valid as a string of `schema`."""
    choices = schema.get("enum") if "enum" in schema else ([schema["const"]] if "const" in schema else None)
    if choices is not None:
        texts = [c for c in choices if isinstance(c, str) and not any(x in c for x in VALUE_EXCLUDES)]
        if not texts:
            raise AnswerFormatError(path, "no string value of this enum can be written as a tool-call parameter")
        return _const(texts[0]) if len(texts) == 1 else {"type": "or", "elements": [_const(t) for t in texts]}
    pattern = schema.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise AnswerFormatError(f"{path}.pattern", "pattern must be a string")
        if any(k in schema for k in _LENGTH_KEYWORDS):
            raise AnswerFormatError(path, "a string parameter with both a pattern and length bounds is not supported")
        return {"type": "regex", "pattern": pattern}
    return {"type": "any_text", "excludes": list(VALUE_EXCLUDES)}


def _bounded_line(schema: Mapping[str, Any], end: str, path: str) -> dict[str, Any]:
    """A string with length bounds and the parameter's closing tag, in one grammar: one line
    without `<` (so no marker fits in it). A character class that could also start the closing
    tag makes the library track every split point: seconds to compile a maxLength of 1000."""
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(low, int) or (high is not None and (not isinstance(high, int) or high < low)):
        raise AnswerFormatError(path, "minLength and maxLength must be integers, minLength <= maxLength")
    repeat = f"{{{low},{'' if high is None else high}}}"
    return {"type": "grammar", "grammar": f"root ::= [^<\\n\\r]{repeat} {json.dumps(end)}"}


def _calls(bodies: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    one = _either(bodies)
    if not parallel:
        return one
    return _sequence([one, {"type": "star", "content": _sequence([_const("\n"), one])}])


def _either(formats: list[dict[str, Any]]) -> dict[str, Any]:
    return formats[0] if len(formats) == 1 else {"type": "or", "elements": formats}


def _resolve_root(parameters: Any, path: str) -> Mapping[str, Any]:
    """The parameters object schema, through one top-level $ref into its own definitions."""
    if parameters is None:
        return {}
    if not isinstance(parameters, Mapping):
        raise AnswerFormatError(path, "the parameters schema must be an object")
    ref = parameters.get("$ref")
    if not isinstance(ref, str):
        return parameters
    for keyword in _DEFINITION_KEYWORDS:
        prefix = f"#/{keyword}/"
        target = parameters.get(keyword, {}).get(ref[len(prefix):]) if ref.startswith(prefix) else None
        if isinstance(target, Mapping):
            return {**{k: parameters[k] for k in _DEFINITION_KEYWORDS if k in parameters}, **target}
    raise AnswerFormatError(f"{path}.$ref", f"the reference {ref!r} does not name a definition of this schema")


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _sequence(elements: list[dict[str, Any]]) -> dict[str, Any]:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _tag(fmt: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": fmt}


@functools.lru_cache(maxsize=CHECKED_GRAMMARS)
def _checked_grammar(tag: str) -> tuple[str, str]:
    """(digest, EBNF with shared rules) of a structural tag the library has parsed (raises what
    the library raises); an agent sends the same tools every turn, so each is converted once."""
    library = grammar_library()
    ebnf = shared_rules(unrolled_repetitions(str(library.Grammar.from_structural_tag(tag))))
    library.Grammar.from_ebnf(ebnf)  # the merged text reads back (it is what the engine compiles)
    return hashlib.sha256(ebnf.encode()).hexdigest(), ebnf


def _reason(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    return _LOG_PREFIX.sub("", text.splitlines()[0])


def canonical_json(value: Any) -> str:
    """One text per grammar (member order kept: it is the parameter order)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
