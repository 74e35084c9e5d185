"""Structured-output rules the three protocols share: JSON answer formats, the tool choice that
forces or constrains calls, and which requests get a grammar at all.

Each protocol reads its own spellings (Chat's `response_format` and nested `function`, Responses'
flat `text.format` and functions, Messages' `output_config.format`, `any` and `tool`) into these
shapes; `answer_format` then decides the grammar:
- a named tool: exactly one call of it;
- required (Chat / Responses `required`, Messages `any`): one or more calls of the callable tools
  (exactly one when parallel calls are off), nothing else;
- auto with a callable `strict` tool, or with parallel calls off: free text, then optionally the
  calls (arguments valid for their schemas, one call when parallel calls are off);
- a JSON format: the answer is that JSON, or, when tools are callable, the JSON or the calls;
- none of these: no grammar (plain decoding, the default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ninfer.frontend.answer_format import AnswerFormat, JsonAnswer, ToolCalls, ToolSchema
from ninfer.server.errors import invalid
from ninfer.server.validation.fields import (
    optional_bool,
    optional_object,
    optional_str,
    required_str,
    wrong_type,
)

JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"  # auto | none | required | named
    name: str | None = None  # the named tool (its prompt identity)


@dataclass(frozen=True)
class DeclaredTool:
    name: str  # its prompt identity
    parameters: dict[str, Any] | None
    path: str  # the request field of its parameters schema
    strict: bool = False


def json_format(
    fmt: dict | None, path: str, *, nested: bool, kinds: tuple[str, ...] = ("text", "json_object", "json_schema")
) -> JsonAnswer | None:
    """A JSON answer from an output format object, None for plain text.

    nested: Chat's shape, whose json_schema type carries {name, schema, strict, description} in a
    `json_schema` member; otherwise the members sit beside `type` (Responses, Messages)."""
    if fmt is None:
        return None
    kind = required_str(fmt, "type", f"{path}.type")
    if kind not in kinds:
        raise invalid(f"{path}.type", f"{path}.type must be {' or '.join(kinds)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonAnswer(JSON_OBJECT_SCHEMA, path)
    holder, holder_path = fmt, path
    if nested:
        holder_path = f"{path}.json_schema"
        holder = optional_object(fmt, "json_schema", holder_path)
        if holder is None:
            raise invalid(holder_path, f"{holder_path} is required", code="missing_required_parameter")
    name = optional_str(holder, "name", f"{holder_path}.name")
    if name is not None and not name:
        raise invalid(f"{holder_path}.name", f"{holder_path}.name must not be empty")
    optional_str(holder, "description", f"{holder_path}.description")
    optional_bool(holder, "strict", f"{holder_path}.strict")  # the schema is enforced either way
    schema = holder.get("schema")
    if schema is None:
        raise invalid(f"{holder_path}.schema", f"{holder_path}.schema is required", code="missing_required_parameter")
    if not isinstance(schema, dict):
        raise wrong_type(f"{holder_path}.schema", "an object", schema)
    return JsonAnswer(schema, f"{holder_path}.schema")


def tool_strict(raw: dict, path: str) -> bool:
    return bool(optional_bool(raw, "strict", f"{path}.strict"))


def answer_format(
    json: JsonAnswer | None,
    declared: list[DeclaredTool],
    callable_names: list[str],
    choice: ToolChoice,
    parallel: bool,
    choice_path: str = "tool_choice",
) -> AnswerFormat | None:
    """The grammar a request's answer follows (module docstring), or None for plain decoding."""
    by_name = {tool.name: tool for tool in declared}
    callable_tools = [by_name[name] for name in callable_names]
    if choice.mode == "named":
        if choice.name not in by_name:
            raise invalid(choice_path, f"{choice_path} names {choice.name!r}, which is not a declared tool")
        calls = ToolCalls((_schema(by_name[choice.name]),), required=True, parallel=False)
    elif choice.mode == "required":
        if not callable_tools:
            raise invalid(choice_path, f"{choice_path} requires a tool call, but no tool can be called")
        calls = ToolCalls(tuple(_schema(t) for t in callable_tools), required=True, parallel=parallel)
    elif callable_tools and (json is not None or not parallel or any(t.strict for t in callable_tools)):
        calls = ToolCalls(tuple(_schema(t) for t in callable_tools), required=False, parallel=parallel)
    else:
        calls = None
    if json is None and calls is None:
        return None
    return AnswerFormat(json=json, calls=calls)


def _schema(tool: DeclaredTool) -> ToolSchema:
    return ToolSchema(tool.name, tool.parameters, tool.path)
