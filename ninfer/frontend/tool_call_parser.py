"""ToolCallParser: turns a held Qwen XML tool-call region into structured calls, or a fallback.

The region is the model text from the first complete `<tool_call>` opener to the end of the
output; the Qwen 3.5+ templates ask for

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE (several lines allowed)
    </parameter>
    </function>
    </tool_call>

with parallel calls as whitespace-separated blocks. The format has no escape, so values end
at the *balanced* `</parameter>`: a value may contain function/tool-call markers and balanced
nested `<parameter=..>..</parameter>` text, while an unmatched nested opener or a standalone
`</parameter>` is ambiguous and sends the whole region back to text.

Argument typing follows the request's tool schemas (a direct primitive `type`, or an
anyOf/oneOf made only of explicit primitive types, guides conversion; anything else keeps
untyped inference). Typing never decides *whether* a region is a call, only its values.

Tolerant mode (`--tolerant-tool-calls`) additionally recovers complete
`<function=..>..</function>` calls whose `<tool_call>` wrapper is missing or unclosed, or
which are followed by trailing text; that text is returned to the caller as content.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"

# JSON Schema primitive type names that may guide conversion.
PRIMITIVE_TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})

_WHITESPACE = re.compile(r"\s*")
# A nested opener needs a complete header; a bare "<parameter=" in code is just text.
_NESTED_MARKER = re.compile(r"<parameter=[^<>\n]+>|</parameter>")
# Names a model could plausibly mean as a function; declared names are accepted regardless.
_PLAUSIBLE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,255}", re.ASCII)


def region_openers(tolerant: bool) -> tuple[str, ...]:
    """Markers that open a held tool region (tolerant mode also accepts a bare function block)."""
    return (TOOL_CALL_OPEN, FUNCTION_OPEN) if tolerant else (TOOL_CALL_OPEN,)


class FallbackReason(str, enum.Enum):
    NONE = "none"
    MALFORMED_STRUCTURE = "malformed_structure"
    DUPLICATE_PARAMETER = "duplicate_parameter"
    INVALID_TOOL_NAME = "invalid_tool_name"
    UNDECLARED_TOOL = "undeclared_tool"
    TRAILING_CONTENT = "trailing_content"


@dataclass(frozen=True, slots=True)
class ToolCallParseDiagnostics:
    """request_done.result.tool_call_parse: counters only, never arguments or text."""

    complete_marker_seen: bool = False
    structured_calls: int = 0
    empty_non_string_arguments_omitted: int = 0
    schema_mismatched_arguments_preserved: int = 0
    fallback_reason: FallbackReason = FallbackReason.NONE

    def to_dict(self) -> dict[str, Any]:
        return {
            "complete_marker_seen": self.complete_marker_seen,
            "structured_calls": self.structured_calls,
            "empty_non_string_arguments_omitted": self.empty_non_string_arguments_omitted,
            "schema_mismatched_arguments_preserved": self.schema_mismatched_arguments_preserved,
            "fallback_reason": self.fallback_reason.value,
        }


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    index: int
    name: str
    # JSON text of each `"key": value` member, in the model's parameter order.
    members: tuple[str, ...]

    @property
    def arguments(self) -> str:
        """The arguments JSON object text (json.dumps layout, parameter order kept)."""
        return "{" + ", ".join(self.members) + "}"

    def argument_pieces(self) -> list[str]:
        """A few pieces, one per member, whose concatenation is `arguments` (for streaming)."""
        if not self.members:
            return ["{}"]
        pieces = ["{" + self.members[0]] + [", " + member for member in self.members[1:]]
        pieces[-1] += "}"
        return pieces


@dataclass(frozen=True, slots=True)
class ToolCallParse:
    calls: tuple[ParsedToolCall, ...]
    # Tolerant recovery only: non-whitespace text after the recovered calls, kept as content.
    trailing_text: str
    diagnostics: ToolCallParseDiagnostics

    @property
    def fallback_reason(self) -> FallbackReason:
        return self.diagnostics.fallback_reason

    @property
    def structured(self) -> bool:
        return self.diagnostics.fallback_reason is FallbackReason.NONE


class _Malformed(Exception):
    def __init__(self, reason: FallbackReason = FallbackReason.MALFORMED_STRUCTURE):
        super().__init__(reason.value)
        self.reason = reason


@dataclass(slots=True)
class _RawCall:
    name: str
    parameters: list[tuple[str, str]]  # (name, value text after newline trimming)


class ArgumentOutcome(enum.Enum):
    KEPT = enum.auto()
    OMITTED = enum.auto()  # empty block of a declared non-string parameter
    MISMATCH = enum.auto()  # nonempty value the declared types do not admit


_NOT_JSON = object()


class ToolCallParser:
    def __init__(self, tools: Mapping[str, Mapping[str, Any] | None], tolerant: bool = False):
        """`tools`: callable tool name -> JSON Schema of its parameters (None: no schema)."""
        self._tools = tools
        self._tolerant = tolerant

    def parse(self, region: str) -> ToolCallParse:
        """Parse a region that starts with a complete opener (see `region_openers`)."""
        trailing = ""
        try:
            raw_calls = _strict_structure(region)
        except _Malformed as error:
            raw_calls, end = _tolerant_structure(region) if self._tolerant else ([], 0)
            if not raw_calls:
                return _fallback(error.reason)
            if region[end:].strip():
                trailing = region[end:]

        for call in raw_calls:
            if call.name not in self._tools:
                plausible = _PLAUSIBLE_NAME.fullmatch(call.name) is not None
                return _fallback(FallbackReason.UNDECLARED_TOOL if plausible else FallbackReason.INVALID_TOOL_NAME)
            names = [name for name, _ in call.parameters]
            if len(set(names)) != len(names):
                return _fallback(FallbackReason.DUPLICATE_PARAMETER)

        calls: list[ParsedToolCall] = []
        omitted = mismatched = 0
        for index, call in enumerate(raw_calls):
            properties = _properties(self._tools[call.name])
            members: list[str] = []
            for name, text in call.parameters:
                value, outcome = convert_argument(text, declared_types(properties.get(name)))
                if outcome is ArgumentOutcome.OMITTED:
                    omitted += 1
                    continue
                mismatched += outcome is ArgumentOutcome.MISMATCH
                members.append(_dumps(name) + ": " + _dumps(value))
            calls.append(ParsedToolCall(index, call.name, tuple(members)))

        diagnostics = ToolCallParseDiagnostics(
            complete_marker_seen=True,
            structured_calls=len(calls),
            empty_non_string_arguments_omitted=omitted,
            schema_mismatched_arguments_preserved=mismatched,
        )
        return ToolCallParse(tuple(calls), trailing, diagnostics)


def declared_types(schema: Any) -> frozenset[str] | None:
    """The primitive types a parameter schema declares, or None for untyped inference."""
    if not isinstance(schema, Mapping):
        return None
    direct = _explicit_types(schema.get("type"))
    if direct is not None:
        return direct
    for keyword in ("anyOf", "oneOf"):
        branches = schema.get(keyword)
        if not isinstance(branches, list) or not branches:
            continue
        union: set[str] = set()
        for branch in branches:
            types = _explicit_types(branch.get("type")) if isinstance(branch, Mapping) else None
            if types is None:
                return None  # one branch without an explicit primitive type: untyped
            union |= types
        return frozenset(union)
    return None


def convert_argument(text: str, types: frozenset[str] | None) -> tuple[Any, ArgumentOutcome]:
    """Typed value of one parameter's text; see the module docstring for the rules."""
    if types is None:
        parsed = _loads(text)
        return (text if parsed is _NOT_JSON else parsed), ArgumentOutcome.KEPT
    if "string" in types:
        return text, ArgumentOutcome.KEPT
    if not text.strip():
        return None, ArgumentOutcome.OMITTED
    parsed = _loads(text)
    if parsed is not _NOT_JSON:
        return parsed, (ArgumentOutcome.KEPT if _admits(types, parsed) else ArgumentOutcome.MISMATCH)
    word = text.strip().lower()
    if "boolean" in types and word in ("true", "false"):
        return word == "true", ArgumentOutcome.KEPT
    return text, ArgumentOutcome.MISMATCH


def _fallback(reason: FallbackReason) -> ToolCallParse:
    return ToolCallParse((), "", ToolCallParseDiagnostics(complete_marker_seen=True, fallback_reason=reason))


def _strict_structure(text: str) -> list[_RawCall]:
    """Every block wrapped in <tool_call>..</tool_call>, only whitespace between and after."""
    calls: list[_RawCall] = []
    pos = 0
    while text.startswith(TOOL_CALL_OPEN, pos):
        pos = _skip_whitespace(text, pos + len(TOOL_CALL_OPEN))
        call, pos = _function_block(text, pos)
        pos = _skip_whitespace(text, pos)
        if not text.startswith(TOOL_CALL_CLOSE, pos):
            raise _Malformed()
        pos = _skip_whitespace(text, pos + len(TOOL_CALL_CLOSE))
        calls.append(call)
    if not calls:
        raise _Malformed()
    if pos < len(text):
        # Text after the last </tool_call> is a suffix; text between blocks is broken structure.
        later_close = TOOL_CALL_CLOSE in text[pos:]
        raise _Malformed(FallbackReason.MALFORMED_STRUCTURE if later_close else FallbackReason.TRAILING_CONTENT)
    return calls


def _tolerant_structure(text: str) -> tuple[list[_RawCall], int]:
    """Leading complete function blocks, each with an optional wrapper; returns (calls, end)."""
    calls: list[_RawCall] = []
    end = 0
    while True:
        pos = _skip_whitespace(text, end)
        if text.startswith(TOOL_CALL_OPEN, pos):
            pos = _skip_whitespace(text, pos + len(TOOL_CALL_OPEN))
        try:
            call, pos = _function_block(text, pos)
        except _Malformed:
            return calls, end
        after = _skip_whitespace(text, pos)
        if text.startswith(TOOL_CALL_CLOSE, after):
            pos = after + len(TOOL_CALL_CLOSE)
        calls.append(call)
        end = pos


def _function_block(text: str, pos: int) -> tuple[_RawCall, int]:
    """Parse `<function=NAME> (<parameter=P>..</parameter>)* </function>` at `pos`."""
    if not text.startswith(FUNCTION_OPEN, pos):
        raise _Malformed()
    name, pos = _header(text, pos + len(FUNCTION_OPEN))
    parameters: list[tuple[str, str]] = []
    while True:
        pos = _skip_whitespace(text, pos)
        if text.startswith(FUNCTION_CLOSE, pos):
            return _RawCall(name, parameters), pos + len(FUNCTION_CLOSE)
        if not text.startswith(PARAMETER_OPEN, pos):
            raise _Malformed()  # stray text, or a standalone </parameter>
        parameter, start = _header(text, pos + len(PARAMETER_OPEN))
        if not parameter:
            raise _Malformed()
        end = _value_end(text, start)
        parameters.append((parameter, _trim_newlines(text[start:end])))
        pos = end + len(PARAMETER_CLOSE)


def _header(text: str, pos: int) -> tuple[str, int]:
    """The name in `<function=NAME>` / `<parameter=NAME>` starting at `pos`, and the index after `>`."""
    close = text.find(">", pos)
    if close < 0:
        raise _Malformed()
    name = text[pos:close]
    if "\n" in name or "<" in name:
        raise _Malformed()
    return name, close + 1


def _value_end(text: str, pos: int) -> int:
    """Index of the `</parameter>` that balances the opener just before `pos`."""
    depth = 1
    for marker in _NESTED_MARKER.finditer(text, pos):
        if marker.group() == PARAMETER_CLOSE:
            depth -= 1
            if depth == 0:
                return marker.start()
        else:
            depth += 1
    raise _Malformed()  # unclosed value or unmatched nested opener


def _trim_newlines(value: str) -> str:
    # The template writes "\n" + value + "\n"; only that framing is removed.
    return value.removeprefix("\n").removesuffix("\n")


def _skip_whitespace(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()  # type: ignore[union-attr]  # \s* always matches


def _properties(schema: Mapping[str, Any] | None) -> Mapping[str, Any]:
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    return properties if isinstance(properties, Mapping) else {}


def _explicit_types(value: Any) -> frozenset[str] | None:
    if isinstance(value, str):
        return frozenset((value,)) if value in PRIMITIVE_TYPES else None
    if isinstance(value, list) and value and all(isinstance(t, str) and t in PRIMITIVE_TYPES for t in value):
        return frozenset(value)
    return None


def _admits(types: frozenset[str], value: Any) -> bool:
    if isinstance(value, bool):
        return "boolean" in types
    if value is None:
        return "null" in types
    if isinstance(value, int):
        return "integer" in types or "number" in types
    if isinstance(value, float):
        return "number" in types or ("integer" in types and value.is_integer())
    if isinstance(value, str):
        return "string" in types
    if isinstance(value, dict):
        return "object" in types
    return "array" in types  # list: the only JSON kind left


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("number out of range")  # would not survive re-serialization as JSON
    return value


def _loads(text: str) -> Any:
    """Strict JSON (no NaN/Infinity, no overflowing numbers), or _NOT_JSON."""
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError):
        return _NOT_JSON


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
