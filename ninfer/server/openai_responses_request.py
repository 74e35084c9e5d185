"""ResponsesRequest: an OpenAI Responses create (or input_tokens) body validated into normalized
Items, function identities and generation options, plus the Item history -> Conversation step.

Every create field of the spec is mapped, accepted as advisory, or rejected with a field-specific
APIError; unknown top-level fields are unknown_parameter. Input Items are normalized into their
wire form (ids assigned, string content expanded into parts); those dicts are what input_items
lists and what a stored chain replays, so one converter turns any Item history into a prompt.

Function identity: a namespaced function is rendered to the model as `namespace__name`; the
request's own table maps generated names back, so the scheme only has to be injective within
one request (collisions are rejected) and stable across requests (replays render identically).

The file is long because the spec gives some forty fields and nine Item shapes a rule each;
keeping one protocol's request rules together makes it auditable against the spec.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ninfer.contract.sampling import SamplingOverrides
from ninfer.frontend.capabilities import EFFORT_TIERS, TemplateCapabilities
from ninfer.frontend.conversation import (
    Conversation,
    Message,
    Part,
    TextPart,
    Tool,
    ToolCall,
)
from ninfer.server.errors import APIError, invalid
from ninfer.server.json_fields import (
    cannot_provide,
    json_type,
    optional_bool,
    optional_int,
    optional_list,
    optional_number,
    optional_object,
    optional_str,
    required_str,
    wrong_type,
)

# Top-level fields of POST /v1/responses and of POST /v1/responses/input_tokens.
CREATE_FIELDS = frozenset(
    {
        "model", "input", "instructions", "previous_response_id", "max_output_tokens", "stream", "store",
        "temperature", "top_p", "metadata", "client_metadata", "reasoning", "preserve_thinking",
        "chat_template_kwargs", "text", "tools", "tool_choice", "parallel_tool_calls", "max_tool_calls",
        "truncation", "top_logprobs", "service_tier", "background", "include", "stream_options",
        "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "safety_identifier", "user",
        # Recognised features NInfer cannot provide: rejected by name when they ask for something.
        "conversation", "prompt", "context_management", "moderation", "background_options",
        "access_programs", "image",
    }
)  # fmt: skip
COUNT_FIELDS = frozenset(
    {
        "model", "input", "instructions", "previous_response_id", "reasoning", "tools", "tool_choice",
        "parallel_tool_calls", "text", "truncation", "preserve_thinking", "chat_template_kwargs",
        "conversation", "personality",
    }
)  # fmt: skip
UNPROVIDABLE_FIELDS = {
    "conversation": "Conversations (use previous_response_id)",
    "prompt": "stored prompt templates",
    "context_management": "server-side context management (compaction)",
    "moderation": "hosted moderation",
    "background_options": "background execution",
    "access_programs": "access programs",
    "image": "image input options (vision is not enabled)",
    "personality": "personality presets",
}
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
CACHE_TTLS = ("30m", "12h")
PROMPT_CACHE_RETENTIONS = ("in_memory", "24h")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast", "ultrafast")
ITEM_STATUSES = ("in_progress", "completed", "incomplete")
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
MEDIA_SCHEMES = ("http://", "https://", "data:")
# Item types of hosted tools and server features: recognised, not executable here.
UNSUPPORTED_ITEMS = {
    "item_reference": "Item references (send the Item itself or use previous_response_id)",
    "custom_tool_call": "custom tool calls",
    "custom_tool_call_output": "custom tool results",
    "compaction": "compaction Items",
    "mcp_call": "remote MCP calls",
    "mcp_list_tools": "remote MCP tool listings",
    "mcp_approval_request": "remote MCP approvals",
    "mcp_approval_response": "remote MCP approvals",
}
_ID_PREFIX = {"message": "msg_", "reasoning": "rs_", "function_call": "fc_", "function_call_output": "fco_"}
_ASSISTANT_STAGE = {"reasoning": 0, "message": 1, "function_call": 2}  # representable turn order
_MAX_CACHE_WRITES = 4


@dataclass(frozen=True)
class ResponsesContext:
    """Server facts the request rules depend on."""

    model_id: str
    capabilities: TemplateCapabilities


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
class ResponsesRequest:
    items: list[dict[str, Any]]  # normalized input Items, client order
    item_paths: list[str]  # input[i] of each Item, for errors found while assembling history
    instructions: str | None
    previous_response_id: str | None
    tools: list[Tool]  # every declared function, declaration order, by identity
    functions: dict[str, FunctionRef]  # identity -> protocol name
    callable_tools: dict[str, dict | None]  # effective set for the decoder: identity -> parameters
    enable_thinking: bool | None
    template_effort: str | None
    preserve_thinking: bool | None  # None: inherit from the parent, else the server default
    implicit_cache_breakpoint: bool
    max_output_tokens: int | None = None  # None: --default-max-tokens
    stream: bool = False
    store: bool = True
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)
    echo: dict[str, Any] = field(default_factory=dict)  # request configuration the Response repeats


def parse_create(body: Any, context: ResponsesContext) -> ResponsesRequest:
    """Validate a POST /v1/responses body; raises APIError naming the offending field."""
    return _parse(body, context, CREATE_FIELDS, model_required=True)


def parse_input_tokens(body: Any, context: ResponsesContext) -> ResponsesRequest:
    """Validate a POST /v1/responses/input_tokens body (the prompt-shaping subset of create)."""
    return _parse(body, context, COUNT_FIELDS, model_required=False)


def _parse(body: Any, context: ResponsesContext, allowed: frozenset[str], model_required: bool) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not {json_type(body)}", code="invalid_type")
    for key in body:
        if key not in allowed:
            raise invalid(key, f"Unknown parameter: {key!r}.", code="unknown_parameter")
    model = _check_model(body, context.model_id, model_required)
    for key, capability in UNPROVIDABLE_FIELDS.items():
        if key in allowed and body.get(key) not in (None, [], {}):
            raise cannot_provide(key, capability)
    previous = optional_str(body, "previous_response_id", "previous_response_id")
    if previous is not None and not previous:
        raise invalid("previous_response_id", "previous_response_id must not be empty")
    items, paths = _InputParser().parse(body.get("input"), previous is not None)
    instructions = optional_str(body, "instructions", "instructions")
    tools, functions, tools_echo = _parse_tools(body)
    callable_tools, tool_choice = _callable_tools(body, tools, functions)
    thinking = _Thinking.parse(body, context.capabilities)
    text = _text_config(body)
    _check_truncation(body)
    request = ResponsesRequest(
        items=items,
        item_paths=paths,
        instructions=instructions,
        previous_response_id=previous,
        tools=tools,
        functions=functions,
        callable_tools=callable_tools,
        enable_thinking=thinking.enable_thinking,
        template_effort=thinking.template_effort,
        preserve_thinking=thinking.preserve_thinking,
        implicit_cache_breakpoint=True,
    )
    request.echo = {
        "model": model,
        "instructions": instructions,
        "previous_response_id": previous,
        "reasoning": thinking.echo,
        "text": text,
        "tools": tools_echo,
        "tool_choice": tool_choice,
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "truncation": "disabled",
    }
    if allowed is CREATE_FIELDS:
        _parse_create_options(body, request)
    return request


def _parse_create_options(body: dict, request: ResponsesRequest) -> None:
    """Fields that shape generation, storage or transport rather than the prompt."""
    request.max_output_tokens = optional_int(body, "max_output_tokens", 0)
    request.stream = bool(optional_bool(body, "stream", "stream"))
    request.store = optional_bool(body, "store", "store") is not False
    request.sampling = SamplingOverrides(
        temperature=optional_number(body, "temperature", 0, 2),
        top_p=optional_number(body, "top_p", 0, 1),
    )
    max_tool_calls = optional_int(body, "max_tool_calls", 0)  # hosted-tool limit: nothing to execute here
    top_logprobs = optional_int(body, "top_logprobs", 0, 20)
    if top_logprobs:
        raise cannot_provide("top_logprobs", "token log probabilities")
    tier = _enum(body, "service_tier", "service_tier", SERVICE_TIERS)
    if tier not in (None, "auto", "default"):
        raise cannot_provide("service_tier", f"the {tier} service tier (only auto or default)")
    if optional_bool(body, "background", "background"):
        raise cannot_provide("background", "background execution")
    include = optional_list(body, "include", "include")
    if include:
        raise cannot_provide("include", f"additional output data ({', '.join(map(str, include))})")
    stream_options = optional_object(body, "stream_options", "stream_options") or {}
    # Advisory: this local server never pads deltas, so there is nothing to switch off.
    optional_bool(stream_options, "include_obfuscation", "stream_options.include_obfuscation")
    client_metadata = body.get("client_metadata")
    if client_metadata is not None and not isinstance(client_metadata, dict):
        raise wrong_type("client_metadata", "an object or null", client_metadata)
    for key in ("prompt_cache_key", "safety_identifier", "user"):
        optional_str(body, key, key)
    retention = _enum(body, "prompt_cache_retention", "prompt_cache_retention", PROMPT_CACHE_RETENTIONS)
    request.implicit_cache_breakpoint = _prompt_cache_implicit(body)
    request.echo.update(
        {
            "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": max_tool_calls,
            "metadata": _metadata(body),
            "store": request.store,
            "background": False,
            "service_tier": "default",
            "top_logprobs": 0,
            "prompt_cache_key": body.get("prompt_cache_key"),
            "prompt_cache_retention": retention,
            "safety_identifier": body.get("safety_identifier"),
            "user": body.get("user"),
        }
    )


# ---- JSON shape helpers ----------------------------------------------------------------------


def _enum(obj: dict, key: str, path: str, allowed: tuple[str, ...]) -> str | None:
    value = optional_str(obj, key, path)
    if value is not None and value not in allowed:
        raise invalid(path, f"{path} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _reject_non_finite(constant: str) -> Any:
    raise ValueError(f"{constant} is not valid JSON")


def parse_arguments(text: str) -> dict[str, Any]:
    """A function_call's arguments: a JSON object whose member order is kept (it reaches the prompt)."""
    arguments = json.loads(text, parse_constant=_reject_non_finite)
    if not isinstance(arguments, dict):
        raise TypeError(f"arguments must encode a JSON object, not {json_type(arguments)}")
    return arguments


def new_item_id(kind: str) -> str:
    return _ID_PREFIX[kind] + uuid.uuid4().hex


# ---- top-level options -----------------------------------------------------------------------


def _check_model(body: dict, model_id: str, required: bool) -> str:
    model = body.get("model")
    if model is None and not required:
        return model_id
    model = required_str(body, "model", "model", non_empty=True)
    if model != model_id:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{model_id}'",
            code="model_not_found",
            param="model",
        )
    return model


def _metadata(body: dict) -> dict[str, str]:
    metadata = optional_object(body, "metadata", "metadata") or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid("metadata", f"metadata holds at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise invalid("metadata", f"metadata key {key[:16]!r}... is longer than {MAX_METADATA_KEY} characters")
        if not isinstance(value, str):
            raise wrong_type(f"metadata.{key}", "a string", value)
        if len(value) > MAX_METADATA_VALUE:
            raise invalid(f"metadata.{key}", f"metadata.{key} is longer than {MAX_METADATA_VALUE} characters")
    return dict(metadata)


def _text_config(body: dict) -> dict[str, Any]:
    text = optional_object(body, "text", "text") or {}
    echo: dict[str, Any] = {"format": {"type": "text"}}
    fmt = optional_object(text, "format", "text.format")
    if fmt is not None:
        kind = required_str(fmt, "type", "text.format.type")
        if kind in ("json_object", "json_schema"):
            raise cannot_provide("text.format", f"Structured Outputs / JSON mode ({kind})")
        if kind != "text":
            raise invalid("text.format.type", f"text.format.type must be text, got {kind!r}")
    verbosity = _enum(text, "verbosity", "text.verbosity", ("low", "medium", "high"))
    if verbosity in ("low", "high"):
        raise cannot_provide("text.verbosity", f"{verbosity} output verbosity (only medium)")
    if verbosity is not None:
        echo["verbosity"] = verbosity
    return echo


def _check_truncation(body: dict) -> None:
    truncation = _enum(body, "truncation", "truncation", ("auto", "disabled"))
    if truncation == "auto":
        raise cannot_provide("truncation", "automatic truncation (overlong input fails instead of dropping Items)")


def _prompt_cache_implicit(body: dict) -> bool:
    options = optional_object(body, "prompt_cache_options", "prompt_cache_options")
    if options is None:
        return True
    _enum(options, "ttl", "prompt_cache_options.ttl", CACHE_TTLS)
    # Diagnostics are an optional OpenAI feature; without it the id is simply not compared.
    optional_str(options, "comparison_response_id", "prompt_cache_options.comparison_response_id")
    return _enum(options, "mode", "prompt_cache_options.mode", ("implicit", "explicit")) != "explicit"


def _cache_breakpoint(raw: dict, path: str) -> dict | None:
    marker = optional_object(raw, "prompt_cache_breakpoint", f"{path}.prompt_cache_breakpoint")
    if marker is None:
        return None
    if marker.get("mode") != "explicit":
        raise invalid(f"{path}.prompt_cache_breakpoint.mode", "prompt_cache_breakpoint.mode must be explicit")
    _enum(marker, "ttl", f"{path}.prompt_cache_breakpoint.ttl", CACHE_TTLS)
    return dict(marker)


# ---- reasoning and template options ----------------------------------------------------------


@dataclass
class _Thinking:
    enable_thinking: bool | None = None
    template_effort: str | None = None
    preserve_thinking: bool | None = None
    echo: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, body: dict, caps: TemplateCapabilities) -> _Thinking:
        thinking = cls()
        reasoning = optional_object(body, "reasoning", "reasoning") or {}
        effort = _enum(reasoning, "effort", "reasoning.effort", EFFORT_TIERS)
        summary = _enum(reasoning, "summary", "reasoning.summary", ("auto", "concise", "detailed"))
        legacy = _enum(reasoning, "generate_summary", "reasoning.generate_summary", ("auto", "concise", "detailed"))
        for key, value in (("summary", summary), ("generate_summary", legacy)):
            # "auto" lets the server decide, and NInfer has no summarizer; an explicit style cannot be met.
            if value in ("concise", "detailed"):
                raise cannot_provide(
                    f"reasoning.{key}", f"{value} reasoning summaries (raw reasoning text is returned)"
                )
        context = _enum(reasoning, "context", "reasoning.context", ("auto", "current_turn", "all_turns"))
        if context not in (None, "auto"):
            raise cannot_provide("reasoning.context", "reasoning-context selection (use preserve_thinking)")
        mode = optional_str(reasoning, "mode", "reasoning.mode")
        if mode not in (None, "standard"):
            raise cannot_provide("reasoning.mode", f"the {mode} reasoning mode")
        thinking.echo = {"effort": effort, "summary": summary}
        if effort is not None:
            if effort != "none" and effort not in caps.effort_tiers:
                raise _effort_not_supported(effort, caps)
            enable = effort != "none"
            if not _thinking_reachable(caps, enable):
                raise _effort_not_supported(effort, caps)
            thinking.enable_thinking = enable
            # "none" reaches the template only when it is one of the template's own tiers.
            thinking.template_effort = effort if enable or "none" in caps.effort_tiers else None
        thinking.preserve_thinking = _preserve_thinking(body, caps)
        return thinking


def _effort_not_supported(effort: str, caps: TemplateCapabilities) -> APIError:
    exposed = ", ".join(("none", *(t for t in caps.effort_tiers if t != "none")))
    return APIError(
        400,
        f"reasoning.effort {effort!r} is not exposed by the loaded chat template (supported: {exposed})",
        code="reasoning_effort_not_supported",
        param="reasoning.effort",
    )


def _thinking_reachable(caps: TemplateCapabilities, enable: bool) -> bool:
    """Whether the template can render a new turn with thinking on (or off) at all."""
    if caps.supports_thinking_switch or caps.thinking_default == enable:
        return True
    if enable:
        return any(tier != "none" for tier in caps.effort_tiers)
    return "none" in caps.effort_tiers


def _preserve_thinking(body: dict, caps: TemplateCapabilities) -> bool | None:
    kwargs = optional_object(body, "chat_template_kwargs", "chat_template_kwargs") or {}
    for key, value in kwargs.items():
        if key != "preserve_thinking" and value is not None:
            raise cannot_provide(f"chat_template_kwargs.{key}", "arbitrary chat template variables")
    top = optional_bool(body, "preserve_thinking", "preserve_thinking")
    nested = optional_bool(kwargs, "preserve_thinking", "chat_template_kwargs.preserve_thinking")
    if top is not None and nested is not None and top != nested:
        raise APIError(
            400,
            f"preserve_thinking ({str(top).lower()}) and chat_template_kwargs.preserve_thinking "
            f"({str(nested).lower()}) disagree",
            code="conflicting_template_option",
            param="preserve_thinking",
        )
    value = top if top is not None else nested
    if value and not caps.supports_preserve_thinking:
        param = "preserve_thinking" if top is not None else "chat_template_kwargs.preserve_thinking"
        raise cannot_provide(param, "preserving closed-turn reasoning (the loaded chat template has no such switch)")
    return value


# ---- tools -----------------------------------------------------------------------------------


def _parse_tools(body: dict) -> tuple[list[Tool], dict[str, FunctionRef], list[dict]]:
    raw = optional_list(body, "tools", "tools") or []
    tools: list[Tool] = []
    functions: dict[str, FunctionRef] = {}

    def declare(definition: Any, path: str, namespace: str | None) -> None:
        tool = _function_definition(definition, path, namespace)
        ref = FunctionRef(namespace, required_str(definition, "name", f"{path}.name"))
        if tool.name in functions:
            raise invalid(f"{path}.name", f"{path}: the function {tool.name!r} is declared twice")
        functions[tool.name] = ref
        tools.append(tool)

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
        else:
            raise _tool_type_error(f"{path}.type", kind)
    return tools, functions, list(raw)


def _tool_type_error(path: str, kind: str) -> APIError:
    if kind == "custom":
        return cannot_provide(path, "custom free-form tools (only function tools)")
    if kind == "mcp":
        return cannot_provide(path, "remote MCP tools (declare client-executed functions instead)")
    return cannot_provide(path, f"hosted {kind} tools (only client-executed function tools)")


def _function_definition(raw: dict, path: str, namespace: str | None) -> Tool:
    name = required_str(raw, "name", f"{path}.name", non_empty=True)
    if optional_bool(raw, "strict", f"{path}.strict"):
        raise cannot_provide(f"{path}.strict", "strict schema adherence (constrained decoding)")
    if optional_bool(raw, "defer_loading", f"{path}.defer_loading"):
        raise cannot_provide(f"{path}.defer_loading", "deferred tool loading (tool search)")
    if raw.get("output_schema") is not None:
        raise cannot_provide(f"{path}.output_schema", "function output schemas")
    if optional_bool(raw, "async", f"{path}.async"):
        raise cannot_provide(f"{path}.async", "asynchronous function calls")
    callers = optional_list(raw, "allowed_callers", f"{path}.allowed_callers")
    if callers is not None and "direct" not in callers:
        raise cannot_provide(f"{path}.allowed_callers", "tools the model may not call directly")
    return Tool(
        name=tool_identity(namespace, name),
        description=optional_str(raw, "description", f"{path}.description"),
        parameters=optional_object(raw, "parameters", f"{path}.parameters"),
    )


def _callable_tools(
    body: dict, tools: list[Tool], functions: dict[str, FunctionRef]
) -> tuple[dict[str, dict | None], Any]:
    """The effective callable set for the decoder (identity -> parameters, declaration order) and
    the tool_choice echo."""
    declared = {tool.name: tool.parameters for tool in tools}
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        allowed = set(declared)
    elif choice == "none":
        allowed = set()  # tools stay in the prompt; calls stay text
    elif choice == "required":
        raise cannot_provide("tool_choice", "required tool calls")
    elif isinstance(choice, dict):
        allowed = _allowed_tools(choice, functions)
    else:
        raise invalid("tool_choice", f"tool_choice must be auto, none or an allowed_tools object, got {choice!r}")
    parallel = optional_bool(body, "parallel_tool_calls", "parallel_tool_calls")
    if parallel is False and allowed:
        raise cannot_provide("parallel_tool_calls", "limiting a turn to one tool call")
    callable_tools = {identity: schema for identity, schema in declared.items() if identity in allowed}
    return callable_tools, choice if choice is not None else "auto"


def _allowed_tools(choice: dict, functions: dict[str, FunctionRef]) -> set[str]:
    kind = required_str(choice, "type", "tool_choice.type")
    if kind != "allowed_tools":
        if kind in ("function", "custom", "mcp", "apply_patch", "shell"):
            raise cannot_provide("tool_choice", f"a forced {kind} tool choice")
        raise cannot_provide("tool_choice", f"forcing the hosted {kind} tool")
    mode = required_str(choice, "mode", "tool_choice.mode")
    if mode == "required":
        raise cannot_provide("tool_choice.mode", "required tool calls")
    if mode != "auto":
        raise invalid("tool_choice.mode", f"tool_choice.mode must be auto, got {mode!r}")
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
    return allowed


# ---- input Items -----------------------------------------------------------------------------


class _InputParser:
    """Validates input Items one by one into their normalized wire form."""

    def parse(self, raw: Any, has_previous: bool) -> tuple[list[dict], list[str]]:
        if raw is None or raw == "" or raw == []:
            if not has_previous:
                raise invalid(
                    "input",
                    "input is required unless previous_response_id supplies the conversation",
                    code="missing_required_parameter",
                )
            return [], []
        if isinstance(raw, str):
            content = [{"type": "input_text", "text": raw}]
            return [
                {
                    "id": new_item_id("message"),
                    "type": "message",
                    "role": "user",
                    "content": content,
                    "status": "completed",
                }
            ], ["input"]
        if not isinstance(raw, list):
            raise wrong_type("input", "a string or an array of Items", raw)
        items: list[dict] = []
        paths: list[str] = []
        seen: dict[str, str] = {}
        for i, item in enumerate(raw):
            path = f"input[{i}]"
            supplied = item.get("id") if isinstance(item, dict) else None
            normalized = self._item(item, path)
            if supplied is not None:
                if supplied in seen:
                    raise invalid(
                        f"{path}.id",
                        f"{path}.id {supplied!r} repeats the id of {seen[supplied]}",
                        code="duplicate_item_id",
                    )
                seen[supplied] = path
            items.append(normalized)
            paths.append(path)
        return items, paths

    def _item(self, raw: Any, path: str) -> dict:
        if not isinstance(raw, dict):
            raise wrong_type(path, "an object", raw)
        kind = optional_str(raw, "type", f"{path}.type")
        if kind is None and "role" in raw:
            kind = "message"
        if kind is None:
            raise invalid(f"{path}.type", f"{path}.type is required", code="missing_required_parameter")
        item_id = optional_str(raw, "id", f"{path}.id")
        if item_id is not None and not item_id:
            raise invalid(f"{path}.id", f"{path}.id must not be empty")
        if kind == "message":
            item = self._message(raw, path)
        elif kind == "reasoning":
            item = self._reasoning(raw, path)
        elif kind == "function_call":
            item = self._function_call(raw, path)
        elif kind == "function_call_output":
            item = self._function_call_output(raw, path)
        elif kind in UNSUPPORTED_ITEMS:
            raise cannot_provide(f"{path}.type", UNSUPPORTED_ITEMS[kind])
        else:
            raise cannot_provide(f"{path}.type", f"{kind} Items (hosted tools and server features are not available)")
        return {"id": item_id or new_item_id(kind), **item}

    def _message(self, raw: dict, path: str) -> dict:
        role = required_str(raw, "role", f"{path}.role")
        if role not in MESSAGE_ROLES:
            raise invalid(f"{path}.role", f"{path}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}")
        # Status and phase have no Qwen prompt representation; they are kept as metadata.
        status = _enum(raw, "status", f"{path}.status", ITEM_STATUSES)
        phase = optional_str(raw, "phase", f"{path}.phase")
        content = raw.get("content")
        cpath = f"{path}.content"
        if content is None:
            raise invalid(cpath, f"{cpath} is required", code="missing_required_parameter")
        if isinstance(content, str):
            part_type = "output_text" if role == "assistant" else "input_text"
            parts = [_text_part(part_type, content)]
        elif isinstance(content, list):
            parts = [self._part(part, role, f"{cpath}[{i}]") for i, part in enumerate(content)]
        else:
            raise wrong_type(cpath, "a string or an array of content parts", content)
        item: dict[str, Any] = {"type": "message", "role": role, "content": parts, "status": status or "completed"}
        if phase is not None:
            item["phase"] = phase
        return item

    def _part(self, raw: Any, role: str, path: str) -> dict:
        if not isinstance(raw, dict):
            raise wrong_type(path, "an object", raw)
        kind = required_str(raw, "type", f"{path}.type")
        if kind in ("input_text", "output_text"):
            text = required_str(raw, "text", f"{path}.text")
            if kind == "output_text" and role != "assistant":
                raise invalid(f"{path}.type", f"{path}: output_text parts replay assistant messages")
            part = _text_part("output_text" if role == "assistant" else "input_text", text)
            if kind == "output_text":
                annotations = optional_list(raw, "annotations", f"{path}.annotations")
                part["annotations"] = list(annotations or [])
            marker = _cache_breakpoint(raw, path) if kind == "input_text" else None
            if marker is not None:
                part["prompt_cache_breakpoint"] = marker
            return part
        if kind == "refusal":
            if role != "assistant":
                raise invalid(f"{path}.type", f"{path}: refusal parts replay assistant messages")
            return {"type": "refusal", "refusal": required_str(raw, "refusal", f"{path}.refusal")}
        if kind in ("input_image", "input_video"):
            if role not in ("user", "assistant"):
                raise invalid(f"{path}.type", f"{path}: {kind} parts belong to user or assistant messages")
            _media(raw, kind, path)
        if kind == "input_file":
            raise cannot_provide(path, "file input")
        if kind == "input_audio":
            raise cannot_provide(path, "audio input")
        raise invalid(f"{path}.type", f"{path}.type {kind!r} is not a supported content part type")

    def _reasoning(self, raw: dict, path: str) -> dict:
        content = raw.get("content")
        if not isinstance(content, list) or not content:
            raise cannot_provide(
                path,
                "reasoning Items without raw reasoning_text content (summaries and encrypted content "
                "cannot be replayed into the prompt)",
            )
        texts = []
        for i, part in enumerate(content):
            ppath = f"{path}.content[{i}]"
            if not isinstance(part, dict):
                raise wrong_type(ppath, "an object", part)
            if part.get("type") != "reasoning_text":
                raise invalid(f"{ppath}.type", f"{ppath}.type must be reasoning_text")
            texts.append({"type": "reasoning_text", "text": required_str(part, "text", f"{ppath}.text")})
        summary = optional_list(raw, "summary", f"{path}.summary") or []
        for i, part in enumerate(summary):
            ppath = f"{path}.summary[{i}]"
            if not isinstance(part, dict) or part.get("type") != "summary_text":
                raise invalid(ppath, f"{ppath} must be a summary_text part")
            required_str(part, "text", f"{ppath}.text")
        item: dict[str, Any] = {"type": "reasoning", "summary": list(summary), "content": texts}
        encrypted = optional_str(raw, "encrypted_content", f"{path}.encrypted_content")
        if encrypted is not None:
            item["encrypted_content"] = encrypted  # opaque metadata next to the raw text; never rendered
        status = _enum(raw, "status", f"{path}.status", ITEM_STATUSES)
        if status is not None:
            item["status"] = status
        return item

    def _function_call(self, raw: dict, path: str) -> dict:
        _check_complete_tool_item(raw, path)
        call_id = required_str(raw, "call_id", f"{path}.call_id", non_empty=True)
        name = required_str(raw, "name", f"{path}.name", non_empty=True)
        namespace = optional_str(raw, "namespace", f"{path}.namespace")
        arguments = required_str(raw, "arguments", f"{path}.arguments")
        try:
            parse_arguments(arguments)
        except (ValueError, TypeError) as error:
            raise invalid(f"{path}.arguments", f"{path}.arguments is not a JSON object: {error}") from None
        item: dict[str, Any] = {"type": "function_call", "call_id": call_id, "name": name}
        if namespace:
            item["namespace"] = namespace
        item.update({"arguments": arguments, "status": "completed"})
        return item

    def _function_call_output(self, raw: dict, path: str) -> dict:
        _check_complete_tool_item(raw, path)
        call_id = required_str(raw, "call_id", f"{path}.call_id", non_empty=True)
        output = raw.get("output")
        opath = f"{path}.output"
        if output is None:
            raise invalid(opath, f"{opath} is required", code="missing_required_parameter")
        if isinstance(output, list):
            if not output:
                raise invalid(opath, f"{opath} must be a string or a non-empty array of content parts")
            output = [self._result_part(part, f"{opath}[{i}]") for i, part in enumerate(output)]
        elif not isinstance(output, str):
            raise wrong_type(opath, "a string or an array of content parts", output)
        item: dict[str, Any] = {
            "type": "function_call_output",
            "call_id": call_id,
            "output": output,
            "status": "completed",
        }
        for key in ("name", "namespace"):
            value = optional_str(raw, key, f"{path}.{key}")
            if value:
                item[key] = value
        return item

    @staticmethod
    def _result_part(raw: Any, path: str) -> dict:
        if not isinstance(raw, dict):
            raise wrong_type(path, "an object", raw)
        kind = required_str(raw, "type", f"{path}.type")
        if kind == "input_text":
            part = _text_part("input_text", required_str(raw, "text", f"{path}.text"))
            marker = _cache_breakpoint(raw, path)
            if marker is not None:
                part["prompt_cache_breakpoint"] = marker
            return part
        if kind == "input_image":
            _media(raw, kind, path)
        if kind == "input_file":
            raise cannot_provide(path, "file tool results")
        raise invalid(f"{path}.type", f"{path}.type must be input_text or input_image, got {kind!r}")


def _text_part(kind: str, text: str) -> dict:
    return {"type": kind, "text": text, "annotations": []} if kind == "output_text" else {"type": kind, "text": text}


def _check_complete_tool_item(raw: dict, path: str) -> None:
    status = _enum(raw, "status", f"{path}.status", ITEM_STATUSES)
    if status in ("in_progress", "incomplete"):
        raise cannot_provide(f"{path}.status", f"{status} tool Items (only completed calls and results)")
    caller = optional_object(raw, "caller", f"{path}.caller")
    if caller is not None and caller.get("type") != "direct":
        raise cannot_provide(f"{path}.caller", "programmatic tool callers")
    if optional_bool(raw, "async", f"{path}.async"):
        raise cannot_provide(f"{path}.async", "asynchronous function calls")


def _media(raw: dict, kind: str, path: str) -> NoReturn:
    """Shape checks of an image/video part, then vision_disabled: media needs --vision."""
    if kind == "input_image":
        if raw.get("file_id") is not None:
            raise cannot_provide(f"{path}.file_id", "file-id images (send an image_url)")
        detail = _enum(raw, "detail", f"{path}.detail", ("auto", "low", "high", "original"))
        if detail not in (None, "auto"):
            raise cannot_provide(f"{path}.detail", f"explicit {detail} image detail (only auto)")
        key = "image_url"
    else:
        key = "video_url"
    url = required_str(raw, key, f"{path}.{key}")
    if not url.lower().startswith(MEDIA_SCHEMES):
        raise invalid(f"{path}.{key}", f"{path}.{key} must be an http(s) URL or a data: URI", code="invalid_media")
    raise APIError(400, f"{path}: media input needs a server started with --vision", code="vision_disabled", param=path)


# ---- Item history -> Conversation ------------------------------------------------------------


def build_conversation(
    request: ResponsesRequest, history: list[dict], inherited_preserve_thinking: bool | None
) -> Conversation:
    """The prompt of a request: instructions, the stored chain's Items, then this request's Items."""
    assembler = _HistoryAssembler()
    if request.instructions:
        assembler.messages.append(Message(role="developer", content=[TextPart(request.instructions)]))
    if not request.items and not any(i["type"] == "message" and i["role"] == "user" for i in history):
        raise invalid(
            "input", "input is required: the previous response holds no user query", code="missing_required_parameter"
        )
    for item in history:
        assembler.add(item, "previous_response_id", fresh=False)
    for item, path in zip(request.items, request.item_paths):
        assembler.add(item, path, fresh=True)
    messages = assembler.finish()
    _limit_cache_writes(messages, assembler.fresh_breakpoints, request.implicit_cache_breakpoint)
    preserve = request.preserve_thinking if request.preserve_thinking is not None else inherited_preserve_thinking
    return Conversation(
        messages=messages,
        tools=list(request.tools),
        enable_thinking=request.enable_thinking,
        reasoning_effort=request.template_effort,
        preserve_thinking=preserve,
        implicit_cache_breakpoint=request.implicit_cache_breakpoint,
    )


@dataclass
class _PendingCalls:
    """Calls of the latest assistant turn that results may still answer, in declaration order."""

    calls: list[ToolCall]
    refs: list[tuple[str | None, str]]  # (namespace, name) per call
    answered: int = 0  # results so far, always a declaration-order prefix


class _HistoryAssembler:
    """Groups Items into turns: assistant-owned Items into one assistant message, results in call order."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.fresh_breakpoints: list[TextPart] = []  # explicit markers of this request, in order
        self._turn: Message | None = None
        self._turn_stage = 0
        self._turn_refs: list[tuple[str | None, str]] = []
        self._pending: _PendingCalls | None = None
        self._results: list[tuple[dict, str, bool]] = []

    def add(self, item: dict, path: str, fresh: bool) -> None:
        kind = item["type"]
        if kind == "function_call_output":
            self._close_turn()
            self._results.append((item, path, fresh))
            return
        self._flush_results()
        if kind in _ASSISTANT_STAGE and (kind != "message" or item["role"] == "assistant"):
            self._add_assistant(item, path, fresh)
            return
        self._close_turn()
        if item["role"] == "user":
            self._pending = None  # results after a new user turn cannot be placed
        role = item["role"]
        self.messages.append(Message(role=role, content=self._parts(item["content"], fresh)))

    def finish(self) -> list[Message]:
        self._flush_results()
        self._close_turn()
        return self.messages

    def _add_assistant(self, item: dict, path: str, fresh: bool) -> None:
        stage = _ASSISTANT_STAGE[item["type"]]
        if self._turn is None:
            self._turn = Message(role="assistant")
            self._turn_stage = 0
            self._turn_refs = []
            self._pending = None
            self.messages.append(self._turn)
        elif stage < self._turn_stage:
            raise invalid(
                path,
                f"{path}: a {item['type']} Item cannot follow a later part of the same assistant turn; "
                "one turn renders as reasoning, then message content, then function calls",
                code="invalid_assistant_history",
            )
        self._turn_stage = stage
        turn = self._turn
        if item["type"] == "reasoning":
            turn.reasoning = (turn.reasoning or "") + "".join(part["text"] for part in item["content"])
        elif item["type"] == "message":
            turn.content.extend(self._parts(item["content"], fresh))
        else:
            call_id = item["call_id"]
            if any(call.call_id == call_id for call in turn.tool_calls):
                raise invalid(
                    f"{path}.call_id",
                    f"{path}.call_id {call_id!r} repeats an earlier call of this turn",
                    code="invalid_tool_history",
                )
            name, namespace = item["name"], item.get("namespace")
            turn.tool_calls.append(
                ToolCall(
                    name=tool_identity(namespace, name), arguments=parse_arguments(item["arguments"]), call_id=call_id
                )
            )
            self._turn_refs.append((namespace, name))

    def _close_turn(self) -> None:
        if self._turn is not None and self._turn.tool_calls:
            self._pending = _PendingCalls(list(self._turn.tool_calls), list(self._turn_refs))
        self._turn = None

    def _flush_results(self) -> None:
        """Validate a run of results against the pending calls and render them in call order."""
        if not self._results:
            return
        results, self._results = self._results, []
        pending = self._pending
        ordered: dict[int, tuple[dict, str, bool]] = {}
        for item, path, fresh in results:
            call_id = item["call_id"]
            index = next((i for i, c in enumerate(pending.calls) if c.call_id == call_id), None) if pending else None
            if index is None:
                raise invalid(
                    f"{path}.call_id",
                    f"{path}.call_id {call_id!r} answers no call of the preceding assistant turn",
                    code="invalid_tool_history",
                )
            if index in ordered or index < pending.answered:
                raise invalid(
                    f"{path}.call_id", f"{path}.call_id {call_id!r} is answered twice", code="invalid_tool_history"
                )
            namespace, name = pending.refs[index]
            if item.get("name") not in (None, name) or item.get("namespace") not in (None, namespace):
                raise invalid(
                    path, f"{path}: name/namespace do not match call {call_id!r}", code="invalid_tool_history"
                )
            ordered[index] = (item, path, fresh)
        expected = list(range(pending.answered, pending.answered + len(ordered)))
        if sorted(ordered) != expected:
            # The Qwen prompt pairs results with calls by position only.
            path = results[0][1]
            raise invalid(
                path,
                f"{path}: results must answer the calls in a leading run of their declaration "
                "order; this partial result set cannot be represented",
                code="invalid_tool_history",
            )
        pending.answered += len(ordered)
        for index in expected:
            item, _, fresh = ordered[index]
            output = item["output"]
            content = self._parts(output, fresh) if isinstance(output, list) else [TextPart(output)]
            self.messages.append(Message(role="tool", content=content, tool_call_id=item["call_id"]))

    def _parts(self, parts: list[dict], fresh: bool) -> list[Part]:
        out: list[Part] = []
        for part in parts:
            text = part["refusal"] if part["type"] == "refusal" else part["text"]
            marked = fresh and "prompt_cache_breakpoint" in part
            text_part = TextPart(text, cache_breakpoint=marked)
            if marked:
                self.fresh_breakpoints.append(text_part)
            out.append(text_part)
        return out


def _limit_cache_writes(messages: list[Message], explicit: list[TextPart], implicit: bool) -> None:
    """At most four writes: the implicit target takes a slot unless it is also explicit; the rest
    go to the latest explicit markers. Earlier markers stay in the Items but write nothing."""
    target = None
    if implicit and messages:
        texts = [p for p in messages[-1].content if isinstance(p, TextPart)]
        target = texts[-1] if texts else None  # where the prompt builder places the implicit candidate
    slots = _MAX_CACHE_WRITES if target is None or any(p is target for p in explicit) else _MAX_CACHE_WRITES - 1
    keep = explicit[-slots:]
    for part in explicit:
        if not any(part is kept for kept in keep):
            part.cache_breakpoint = False
