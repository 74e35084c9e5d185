"""Responses function tools: direct functions and namespace groups, tool_choice, hosted tools.

A namespaced function is rendered to the model as `namespace__name`; the request's own table
maps generated names back, so the scheme only has to be injective within one request
(collisions are rejected) and stable across requests (replays render identically).

Hosted tools (web search, file search, ...) run on OpenAI's servers. A request that offers
them without forcing one is served with them left out of the prompt, reported in the log;
forcing one, remote MCP and custom free-form tools are rejected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ninfer.frontend.conversation import Tool
from ninfer.server.errors import APIError, invalid
from ninfer.server.validation.fields import (
    cannot_provide,
    optional_bool,
    optional_list,
    optional_object,
    optional_str,
    required_str,
    wrong_type,
)
from ninfer.server.validation.structured_output import DeclaredTool, ToolChoice, tool_strict
from ninfer.server.validation.tools import HOSTED_TOOL_TYPES, allowed_tools_mode, check_definition_flags


@dataclass(frozen=True)
class FunctionRef:
    """A client function as the protocol names it; `identity` is its name in the prompt."""

    namespace: str | None
    name: str

    @property
    def identity(self) -> str:
        return tool_identity(self.namespace, self.name)


def tool_identity(namespace: str | None, name: str) -> str:
    return f"{namespace}__{name}" if namespace else name


@dataclass
class ResponsesTools:
    tools: list[Tool] = field(default_factory=list)  # every declared function, declaration order, by identity
    functions: dict[str, FunctionRef] = field(default_factory=dict)  # identity -> protocol name
    callable: dict[str, dict | None] = field(default_factory=dict)  # effective set: identity -> parameters
    declared: list[DeclaredTool] = field(default_factory=list)  # for structured outputs (strict, paths)
    choice: ToolChoice = field(default_factory=ToolChoice)
    omitted_hosted: list[str] = field(default_factory=list)  # hosted tool types left out of the prompt
    echo: list[dict] = field(default_factory=list)  # the request's tools, as the Response repeats them
    choice_echo: Any = "auto"


def parse_tools(body: dict) -> ResponsesTools:
    raw = optional_list(body, "tools", "tools") or []
    parsed = ResponsesTools(echo=list(raw))

    def declare(definition: Any, path: str, namespace: str | None) -> None:
        tool = _function_definition(definition, path, namespace)
        ref = FunctionRef(namespace, required_str(definition, "name", f"{path}.name"))
        if tool.name in parsed.functions:
            raise invalid(f"{path}.name", f"{path}: the function {tool.name!r} is declared twice")
        parsed.functions[tool.name] = ref
        parsed.tools.append(tool)
        strict = tool_strict(definition, path)
        parsed.declared.append(DeclaredTool(tool.name, tool.parameters, f"{path}.parameters", strict))

    for i, item in enumerate(raw):
        path = f"tools[{i}]"
        if not isinstance(item, dict):
            raise wrong_type(path, "an object", item)
        kind = required_str(item, "type", f"{path}.type")
        if kind == "function":
            declare(item, path, None)
        elif kind == "namespace":
            namespace = required_str(item, "name", f"{path}.name", non_empty=True)
            optional_str(item, "description", f"{path}.description")
            members = item.get("tools")
            if not isinstance(members, list) or not members:
                raise invalid(f"{path}.tools", f"{path}.tools must be a non-empty array of function definitions")
            for j, member in enumerate(members):
                member_path = f"{path}.tools[{j}]"
                if not isinstance(member, dict):
                    raise wrong_type(member_path, "an object", member)
                member_kind = required_str(member, "type", f"{member_path}.type")
                if member_kind != "function":
                    raise _tool_type_error(f"{member_path}.type", member_kind)
                declare(member, member_path, namespace)
        elif kind in HOSTED_TOOL_TYPES:
            parsed.omitted_hosted.append(kind)
        else:
            raise _tool_type_error(f"{path}.type", kind)
    parsed.callable, parsed.choice, parsed.choice_echo = _callable_tools(body, parsed)
    return parsed


def _tool_type_error(path: str, kind: str) -> APIError:
    if kind == "custom":
        return cannot_provide(path, "custom free-form tools (only function tools)")
    if kind == "mcp":
        return cannot_provide(path, "remote MCP tools (declare client-executed functions instead)")
    return cannot_provide(path, f"{kind} tools (only client-executed function tools)")


def _function_definition(raw: dict, path: str, namespace: str | None) -> Tool:
    name = required_str(raw, "name", f"{path}.name", non_empty=True)
    check_definition_flags(raw, path)
    return Tool(
        name=tool_identity(namespace, name),
        description=optional_str(raw, "description", f"{path}.description"),
        parameters=optional_object(raw, "parameters", f"{path}.parameters"),
    )


def _callable_tools(body: dict, parsed: ResponsesTools) -> tuple[dict[str, dict | None], ToolChoice, Any]:
    """The effective callable set for the decoder (identity -> parameters, declaration order), the
    choice (auto, none, required or one named function) and the tool_choice echo."""
    declared = {tool.name: tool.parameters for tool in parsed.tools}
    choice = body.get("tool_choice")
    mode = ToolChoice("auto")
    if choice is None or choice == "auto":
        allowed = set(declared)
    elif choice == "none":
        allowed, mode = set(), ToolChoice("none")  # tools stay in the prompt; calls stay text
    elif choice == "required":
        allowed, mode = set(declared), ToolChoice("required")
    elif isinstance(choice, dict):
        allowed, mode = _tool_choice_object(choice, parsed.functions)
    else:
        raise invalid("tool_choice", f"tool_choice must be auto, none, required or an object, got {choice!r}")
    callable_tools = {identity: schema for identity, schema in declared.items() if identity in allowed}
    optional_bool(body, "parallel_tool_calls", "parallel_tool_calls")
    return callable_tools, mode, choice if choice is not None else "auto"


def _tool_choice_object(choice: dict, functions: dict[str, FunctionRef]) -> tuple[set[str], ToolChoice]:
    kind = required_str(choice, "type", "tool_choice.type")
    if kind == "function":
        namespace = optional_str(choice, "namespace", "tool_choice.namespace") or None
        ref = FunctionRef(namespace, required_str(choice, "name", "tool_choice.name"))
        if functions.get(ref.identity) != ref:
            raise invalid("tool_choice", "tool_choice does not name a declared function")
        return {ref.identity}, ToolChoice("named", ref.identity)
    if kind != "allowed_tools":
        if kind in ("custom", "mcp", "apply_patch", "shell"):
            raise cannot_provide("tool_choice", f"a forced {kind} tool choice")
        raise cannot_provide("tool_choice", f"forcing the hosted {kind} tool")
    mode = allowed_tools_mode(choice, "tool_choice.mode")
    entries = choice.get("tools")
    if not isinstance(entries, list):
        raise wrong_type("tool_choice.tools", "an array", entries)
    allowed: set[str] = set()
    for i, entry in enumerate(entries):
        path = f"tool_choice.tools[{i}]"
        if not isinstance(entry, dict):
            raise wrong_type(path, "an object", entry)
        entry_kind = required_str(entry, "type", f"{path}.type")
        if entry_kind != "function":
            raise cannot_provide(f"{path}.type", f"allowing {entry_kind} tools (allowed_tools selects functions only)")
        ref = FunctionRef(
            optional_str(entry, "namespace", f"{path}.namespace") or None, required_str(entry, "name", f"{path}.name")
        )
        if functions.get(ref.identity) != ref:  # the pair must match, not just the rendered identity
            raise invalid(path, f"{path} does not name a declared function")
        allowed.add(ref.identity)
    return allowed, ToolChoice(mode)
