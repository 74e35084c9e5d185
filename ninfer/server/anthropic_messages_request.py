"""MessagesRequest: an Anthropic Messages body validated into a Conversation plus generation options.

Create and count_tokens share this lowering, so both see the same prompt: the billing-header
block is consumed, consecutive User/Assistant turns are joined, Thinking history becomes the
turn's reasoning, tool results are paired with their calls and put in call order, a final
text-only Assistant turn becomes a prefill, and cache_control markers become cache_breakpoint
flags. Capabilities the engine cannot provide are rejected with the missing capability named;
advisory fields and unknown fields are ignored. Prompt-bearing JSON keeps its member order.

The file is long because the spec gives most Messages fields a rule; keeping one protocol's
request rules together makes it auditable against the spec paragraph by paragraph.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ninfer.contract.sampling import TOP_K_CAP, SamplingOverrides
from ninfer.frontend.capabilities import TemplateCapabilities
from ninfer.frontend.conversation import Conversation, Message, TextPart, Tool, ToolCall
from ninfer.server.errors import APIError, invalid
from ninfer.server.json_fields import (
    cannot_provide,
    is_int,
    json_type,
    optional_bool,
    optional_list,
    optional_object,
    optional_str,
    required_str,
    wrong_type,
)

# Claude Code's attribution block: consumed when it is the first block of an array-form system.
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
MAX_CACHE_BREAKPOINTS = 4
CACHE_TTLS = ("5m", "1h")
MIN_THINKING_BUDGET = 1024
EFFORTS = ("low", "medium", "high", "xhigh", "max")
# is_error has no slot in the Qwen tool-response markup, so the prompt text states it.
TOOL_ERROR_MARKER = "[is_error: true]\n"
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
ROLES = ("user", "assistant", "system")

# Recognised blocks whose executor or data source NInfer does not have.
_UNSUPPORTED_BLOCKS = {
    "document": "document blocks (Documents and Files)",
    "search_result": "search result blocks",
    "container_upload": "container uploads",
    "redacted_thinking": "encrypted redacted-thinking restore",
    "server_tool_use": "Anthropic server-tool execution",
    "mcp_tool_use": "MCP tool execution",
    "mcp_tool_result": "MCP tool results",
    "web_search_tool_result": "server-tool results (web search)",
    "web_fetch_tool_result": "server-tool results (web fetch)",
    "code_execution_tool_result": "server-tool results (code execution)",
    "bash_code_execution_tool_result": "server-tool results (bash code execution)",
    "text_editor_code_execution_tool_result": "server-tool results (text editor code execution)",
    "tool_search_tool_result": "server-tool results (tool search)",
    "tool_reference": "tool references (deferred tool search)",
    "browser_state": "browser state blocks",
    "compaction": "server-side compaction blocks",
}
# Top-level fields that ask for an executor or constraint NInfer does not have.
_UNSUPPORTED_FIELDS = {
    "container": "containers",
    "mcp_servers": "MCP servers",
    "output_format": "Structured Outputs (constrained decoding)",
}


@dataclass(frozen=True)
class MessagesContext:
    """Server facts the request rules depend on."""

    capabilities: TemplateCapabilities
    default_max_tokens: int  # --default-max-tokens: the output budget when max_tokens is omitted


@dataclass
class MessagesRequest:
    model: str  # the client's label, echoed in the response
    conversation: Conversation
    stream: bool
    max_tokens: int  # resolved complete output budget
    sampling: SamplingOverrides
    stop_sequences: list[str]
    callable_tools: dict[str, dict | None] | None  # name -> input_schema; None: calls stay text
    thinking_budget: int | None  # thinking.type "enabled" budget_tokens
    requested_effort: str | None  # output_config.effort as given


def parse_messages_request(body: Any, context: MessagesContext, *, count_only: bool = False) -> MessagesRequest:
    """Validate a parsed JSON body; raises APIError naming the offending field.

    count_only: the count_tokens body, whose output-only fields (max_tokens, sampling, stop
    sequences, stream) neither are required nor affect the prompt, so they are not read.
    """
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not {json_type(body)}", code="invalid_type")
    model = required_str(body, "model", "model")
    if not model:
        raise invalid("model", "model must be a non-empty string")
    _reject_unprovidable_fields(body)
    if count_only:
        max_tokens, sampling, stop, stream = context.default_max_tokens, SamplingOverrides(), [], False
    else:
        max_tokens = _max_tokens(body, context.default_max_tokens)
        sampling = _sampling(body)
        stop = _stop_sequences(body)
        stream = bool(optional_bool(body, "stream", "stream"))
    thinking = _Thinking.parse(body, context.capabilities, None if count_only else max_tokens)
    effort = _effort(body, context.capabilities)
    preserve = optional_bool(body, "preserve_thinking", "preserve_thinking")
    if preserve and not context.capabilities.supports_preserve_thinking:
        raise cannot_provide(
            "preserve_thinking", "preserving closed-turn reasoning (the loaded chat template has no such switch)"
        )

    lowering = _Lowering()
    tools, schemas = lowering.tools(body)  # tools, then system, then messages: Anthropic's prefix order
    messages = lowering.system(body)
    history, prefill = lowering.messages(body)
    messages += history
    lowering.apply_cache_markers(body)
    if prefill and thinking.enable is True:
        raise cannot_provide("thinking", "an assistant prefill with thinking enabled (a prefill continues answer text)")

    conversation = Conversation(
        messages=messages,
        tools=tools,
        enable_thinking=thinking.enable,
        reasoning_effort=effort,
        preserve_thinking=preserve,
        continue_final_message=prefill,
    )
    return MessagesRequest(
        model=model,
        conversation=conversation,
        stream=stream,
        max_tokens=max_tokens,
        sampling=sampling,
        stop_sequences=stop,
        callable_tools=_callable_tools(body, schemas),
        thinking_budget=thinking.budget,
        requested_effort=effort,
    )


# ---- JSON shape helpers ----------------------------------------------------------------------


def _object(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise wrong_type(path, "an object", value)
    return value


# ---- top-level options -----------------------------------------------------------------------


def _reject_unprovidable_fields(body: dict) -> None:
    for key, capability in _UNSUPPORTED_FIELDS.items():
        if body.get(key) not in (None, [], {}):
            raise cannot_provide(key, capability)
    output_config = optional_object(body, "output_config", "output_config") or {}
    if output_config.get("format") is not None:
        raise cannot_provide("output_config.format", "Structured Outputs (constrained decoding)")
    _check_context_management(body)


def _check_context_management(body: dict) -> None:
    """Only the no-op edit passes: Claude Code sends clear_thinking with keep "all" on every request."""
    config = optional_object(body, "context_management", "context_management") or {}
    edits = optional_list(config, "edits", "context_management.edits") or []
    for i, edit in enumerate(edits):
        path = f"context_management.edits[{i}]"
        edit = _object(edit, path)
        if edit.get("type") != "clear_thinking_20251015" or edit.get("keep") != "all":
            raise cannot_provide(path, f"server-side context editing ({edit.get('type')!r} that removes context)")


def _max_tokens(body: dict, default: int) -> int:
    value = body.get("max_tokens")
    if value is None:
        return default
    if not is_int(value):
        raise wrong_type("max_tokens", "an integer", value)
    if value == 0:
        raise cannot_provide("max_tokens", "max_tokens 0 (a completed zero-output cache-prewarm lifecycle)")
    if value < 0:
        raise invalid("max_tokens", f"max_tokens must be a positive integer, got {value}")
    return value


def _unit_interval(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise wrong_type(key, "a number", value)
    if not math.isfinite(value) or not 0 <= value <= 1:
        raise invalid(key, f"{key} must be between 0 and 1, got {value!r}")
    return float(value)


def _sampling(body: dict) -> SamplingOverrides:
    top_k = body.get("top_k")
    if top_k is not None:
        if not is_int(top_k):
            raise wrong_type("top_k", "an integer", top_k)
        if top_k < 0:
            raise invalid("top_k", f"top_k must be a non-negative integer, got {top_k}")
        if top_k > TOP_K_CAP:
            raise cannot_provide("top_k", f"top_k above {TOP_K_CAP} (the sampler's candidate cap)")
    return SamplingOverrides(
        temperature=_unit_interval(body, "temperature"), top_p=_unit_interval(body, "top_p"), top_k=top_k
    )


def _stop_sequences(body: dict) -> list[str]:
    raw = optional_list(body, "stop_sequences", "stop_sequences") or []
    for i, value in enumerate(raw):
        if not isinstance(value, str):
            raise wrong_type(f"stop_sequences[{i}]", "a string", value)
        if not value:
            raise invalid(f"stop_sequences[{i}]", f"stop_sequences[{i}] must be a non-empty string")
    return list(raw)


def _effort(body: dict, caps: TemplateCapabilities) -> str | None:
    output_config = optional_object(body, "output_config", "output_config") or {}
    effort = optional_str(output_config, "effort", "output_config.effort")
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise invalid(
            "output_config.effort", f"output_config.effort must be one of {', '.join(EFFORTS)}, got {effort!r}"
        )
    if effort not in caps.effort_tiers:
        exposed = ", ".join(tier for tier in caps.effort_tiers if tier in EFFORTS) or "none"
        raise APIError(
            400,
            f"output_config.effort {effort!r} is not exposed by the loaded chat template (supported: {exposed})",
            code="reasoning_effort_not_supported",
            param="output_config.effort",
        )
    return effort


@dataclass
class _Thinking:
    enable: bool | None = None  # None: the server/template default
    budget: int | None = None

    @classmethod
    def parse(cls, body: dict, caps: TemplateCapabilities, max_tokens: int | None) -> _Thinking:
        raw = optional_object(body, "thinking", "thinking")
        if raw is None:
            return cls()
        kind = required_str(raw, "type", "thinking.type")
        if kind == "disabled":
            thinking = cls(enable=False)
        elif kind in ("enabled", "adaptive"):
            display = optional_str(raw, "display", "thinking.display")
            if display == "omitted":
                raise cannot_provide("thinking.display", "omitted thinking (encrypted hidden-reasoning restore)")
            if display not in (None, "summarized"):
                raise invalid("thinking.display", f"thinking.display must be summarized or omitted, got {display!r}")
            thinking = cls(enable=True, budget=_budget(raw, max_tokens) if kind == "enabled" else None)
        elif kind == "between_tools":
            raise cannot_provide("thinking.type", "thinking restricted to between tool calls")
        else:
            raise invalid("thinking.type", f"thinking.type must be enabled, adaptive or disabled, got {kind!r}")
        if not _thinking_reachable(caps, thinking.enable):
            state = "enabling" if thinking.enable else "disabling"
            raise cannot_provide("thinking", f"{state} thinking (the loaded chat template has no thinking switch)")
        return thinking


def _budget(raw: dict, max_tokens: int | None) -> int:
    budget = raw.get("budget_tokens")
    if budget is None:
        raise invalid(
            "thinking.budget_tokens",
            "thinking.budget_tokens is required when thinking is enabled",
            code="missing_required_parameter",
        )
    if not is_int(budget):
        raise wrong_type("thinking.budget_tokens", "an integer", budget)
    if budget < MIN_THINKING_BUDGET:
        raise invalid(
            "thinking.budget_tokens", f"thinking.budget_tokens must be >= {MIN_THINKING_BUDGET}, got {budget}"
        )
    if max_tokens is not None and budget >= max_tokens:
        raise invalid(
            "thinking.budget_tokens", f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})"
        )
    return budget


def _thinking_reachable(caps: TemplateCapabilities, enable: bool | None) -> bool:
    """Whether the template can open a new turn with thinking on (or off) at all."""
    if enable is None or caps.supports_thinking_switch or caps.thinking_default == enable:
        return True
    return any(tier != "none" for tier in caps.effort_tiers) if enable else "none" in caps.effort_tiers


def _callable_tools(body: dict, schemas: dict[str, dict]) -> dict[str, dict | None] | None:
    """The decoder's callable set: every declared tool under auto, nothing under none."""
    choice = body.get("tool_choice")
    if choice is None:
        return dict(schemas) or None
    choice = _object(choice, "tool_choice")
    kind = required_str(choice, "type", "tool_choice.type")
    if kind in ("any", "tool"):
        raise cannot_provide("tool_choice", f"a forced tool choice ({kind}) without constrained decoding")
    if kind not in ("auto", "none"):
        raise invalid("tool_choice.type", f"tool_choice.type must be auto, any, tool or none, got {kind!r}")
    if kind == "none":
        return None  # the tools stay in the prompt; markup stays text
    if optional_bool(choice, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use") and schemas:
        raise cannot_provide("tool_choice.disable_parallel_tool_use", "limiting a turn to one tool call")
    return dict(schemas) or None


# ---- prompt lowering -------------------------------------------------------------------------


@dataclass
class _CacheSlot:
    """A block that accepts cache_control, in Anthropic's prefix order (tools, system, messages)."""

    path: str
    ttl: str | None  # the explicit marker's TTL, None when the block carries none
    mark: Callable[[], None] | None  # sets the cache_breakpoint flag; None: no prompt frontier exists
    targetable: bool = True  # a top-level block the request-level marker may land on


@dataclass
class _Turn:
    role: str
    path: str
    parts: list[TextPart] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    call_paths: list[str] = field(default_factory=list)
    results: list[tuple[str, Message, str]] = field(default_factory=list)  # (tool_use_id, tool message, path)
    content_before_result: str | None = None  # path of a non-result block seen before a later result


class _Lowering:
    def __init__(self) -> None:
        self.slots: list[_CacheSlot] = []

    # -- tools ------------------------------------------------------------------------------

    def tools(self, body: dict) -> tuple[list[Tool], dict[str, dict]]:
        raw = optional_list(body, "tools", "tools") or []
        tools: list[Tool] = []
        schemas: dict[str, dict] = {}
        for i, item in enumerate(raw):
            path = f"tools[{i}]"
            item = _object(item, path)
            tool, schema = self._tool(item, path)
            if tool.name in schemas:
                raise invalid(f"{path}.name", f"{path}.name {tool.name!r} is declared twice")
            schemas[tool.name] = schema
            tools.append(tool)
        return tools, schemas

    def _tool(self, raw: dict, path: str) -> tuple[Tool, dict]:
        kind = optional_str(raw, "type", f"{path}.type")
        if kind not in (None, "custom"):
            what = (
                f"toolsets ({kind})" if "toolset" in kind else f"Anthropic-provided tools ({kind}) and their executors"
            )
            raise cannot_provide(f"{path}.type", what)
        name = required_str(raw, "name", f"{path}.name")
        if not TOOL_NAME.match(name):
            raise invalid(f"{path}.name", f"{path}.name must match ^[a-zA-Z0-9_-]{{1,128}}$, got {name!r}")
        if optional_bool(raw, "strict", f"{path}.strict"):
            raise cannot_provide(f"{path}.strict", "strict schema adherence (constrained decoding)")
        if optional_bool(raw, "defer_loading", f"{path}.defer_loading"):
            raise cannot_provide(f"{path}.defer_loading", "deferred tool loading (tool search)")
        callers = optional_list(raw, "allowed_callers", f"{path}.allowed_callers")
        if callers is not None and "direct" not in callers:
            raise cannot_provide(f"{path}.allowed_callers", "tools that only programmatic callers may invoke")
        optional_bool(raw, "eager_input_streaming", f"{path}.eager_input_streaming")  # transport hint
        schema = raw.get("input_schema")
        if schema is None:
            raise invalid(f"{path}.input_schema", f"{path}.input_schema is required", code="missing_required_parameter")
        schema = _object(schema, f"{path}.input_schema")
        if schema.get("type", "object") != "object":
            raise invalid(f"{path}.input_schema.type", f"{path}.input_schema.type must be object")
        rendered = self._with_examples(raw, schema, path)
        tool = Tool(name=name, description=optional_str(raw, "description", f"{path}.description"), parameters=rendered)
        self._slot(raw, path, lambda: setattr(tool, "cache_breakpoint", True))
        return tool, schema

    @staticmethod
    def _with_examples(raw: dict, schema: dict, path: str) -> dict:
        """input_examples reach the model as the schema's standard `examples` keyword, after its own members."""
        examples = optional_list(raw, "input_examples", f"{path}.input_examples")
        if not examples:
            return schema
        for j, example in enumerate(examples):
            _object(example, f"{path}.input_examples[{j}]")
        if "examples" in schema:
            raise invalid(f"{path}.input_examples", f"{path}: give input_examples or input_schema.examples, not both")
        return {**schema, "examples": examples}

    # -- system -----------------------------------------------------------------------------

    def system(self, body: dict) -> list[Message]:
        system = body.get("system")
        if system is None:
            return []
        if isinstance(system, str):
            return [Message(role="system", content=[TextPart(system)])] if system else []
        if not isinstance(system, list):
            raise wrong_type("system", "a string or an array of text blocks", system)
        blocks = list(enumerate(system))
        if blocks and _is_billing_header(blocks[0][1]):
            blocks = blocks[1:]  # consumed whole, its cache_control included (positional rule)
        parts = [self._system_text(block, f"system[{i}]") for i, block in blocks]
        return [Message(role="system", content=parts)] if parts else []

    def _system_text(self, block: Any, path: str) -> TextPart:
        block = _object(block, path)
        kind = required_str(block, "type", f"{path}.type")
        if kind != "text":
            raise invalid(f"{path}.type", f"{path}.type must be text (system content is text), got {kind!r}")
        return self._text(block, path)

    # -- messages ---------------------------------------------------------------------------

    def messages(self, body: dict) -> tuple[list[Message], bool]:
        """The ordered history and whether its final Assistant turn is a prefill to continue."""
        raw = body.get("messages")
        if raw is None:
            raise invalid("messages", "messages is required", code="missing_required_parameter")
        if not isinstance(raw, list):
            raise wrong_type("messages", "an array of messages", raw)
        if not raw:
            raise invalid("messages", "messages must contain at least one message")
        turns: list[_Turn] = []
        for i, item in enumerate(raw):
            turn = self._turn(item, f"messages[{i}]")
            previous = turns[-1] if turns else None
            if previous is not None and turn.role != "system" and previous.role == turn.role:
                _join(previous, turn)  # Anthropic combines consecutive same-role turns
            else:
                turns.append(turn)
        prefill = False
        final = turns[-1]
        if final.role == "assistant" and final.calls:
            raise invalid(
                final.path,
                f"{final.path}: a final assistant turn with tool_use needs its tool_result "
                "blocks in a following user turn (an assistant prefill cannot contain tool calls)",
            )
        if final.role == "assistant":
            if final.thinking:
                raise cannot_provide(
                    final.path, "an assistant prefill that contains thinking (a prefill continues answer text)"
                )
            if final.parts and any(part.text for part in final.parts):
                prefill = True
            else:
                turns.pop()  # an empty final Assistant turn prefills nothing
        return self._pair_tool_results(turns), prefill

    def _turn(self, raw: Any, path: str) -> _Turn:
        raw = _object(raw, path)
        role = required_str(raw, "role", f"{path}.role")
        if role not in ROLES:
            raise invalid(f"{path}.role", f"{path}.role must be one of {', '.join(ROLES)}, got {role!r}")
        turn = _Turn(role=role, path=path)
        content = raw.get("content")
        if content is None:
            raise invalid(f"{path}.content", f"{path}.content is required", code="missing_required_parameter")
        if isinstance(content, str):
            part = TextPart(content)
            turn.parts.append(part)
            turn.content_before_result = f"{path}.content"
            # String content is one text block: the request-level marker may land on it.
            self._slot({}, f"{path}.content", lambda: setattr(part, "cache_breakpoint", True))
            return turn
        if not isinstance(content, list):
            raise wrong_type(f"{path}.content", "a string or an array of content blocks", content)
        for j, block in enumerate(content):
            self._block(turn, block, f"{path}.content[{j}]")
        return turn

    def _block(self, turn: _Turn, raw: Any, path: str) -> None:
        raw = _object(raw, path)
        kind = required_str(raw, "type", f"{path}.type")
        role = turn.role
        if role == "system" and kind != "text":
            raise invalid(f"{path}.type", f"{path}.type must be text (system content is text), got {kind!r}")
        if kind != "tool_result" and turn.content_before_result is None:
            turn.content_before_result = path
        if kind == "text":
            turn.parts.append(self._text(raw, path))
        elif kind == "image":
            if role != "user":
                raise invalid(f"{path}.type", f"{path}: image blocks belong to user messages and tool results")
            raise _vision_disabled(path)
        elif kind in ("thinking", "redacted_thinking", "tool_use") and role != "assistant":
            raise invalid(f"{path}.type", f"{path}: {kind} blocks belong to assistant messages")
        elif kind == "thinking":
            turn.thinking.append(self._thinking(raw, path))
        elif kind == "tool_use":
            turn.calls.append(self._tool_use(raw, path))
            turn.call_paths.append(path)
        elif kind == "tool_result":
            if role != "user":
                raise invalid(f"{path}.type", f"{path}: tool_result blocks belong to user messages")
            self._tool_result(turn, raw, path)
        elif kind in _UNSUPPORTED_BLOCKS:
            raise cannot_provide(path, _UNSUPPORTED_BLOCKS[kind])
        else:
            raise invalid(f"{path}.type", f"{path}.type {kind!r} is not a known content block type")

    def _text(self, raw: dict, path: str, *, targetable: bool = True) -> TextPart:
        text = required_str(raw, "text", f"{path}.text")
        if raw.get("citations"):
            raise cannot_provide(f"{path}.citations", "citations (they need document or search-result sources)")
        part = TextPart(text)
        self._slot(raw, path, lambda: setattr(part, "cache_breakpoint", True), targetable=targetable)
        return part

    @staticmethod
    def _thinking(raw: dict, path: str) -> str:
        if raw.get("cache_control") is not None:
            raise invalid(f"{path}.cache_control", f"{path}: thinking blocks cannot carry cache_control")
        optional_str(raw, "signature", f"{path}.signature")  # opaque and non-semantic: never interpreted
        return required_str(raw, "thinking", f"{path}.thinking")

    def _tool_use(self, raw: dict, path: str) -> ToolCall:
        call_id = required_str(raw, "id", f"{path}.id")
        if not call_id:
            raise invalid(f"{path}.id", f"{path}.id must not be empty")
        name = required_str(raw, "name", f"{path}.name")
        if not name:
            raise invalid(f"{path}.name", f"{path}.name must not be empty")
        arguments = raw.get("input")
        if arguments is None:
            raise invalid(f"{path}.input", f"{path}.input is required", code="missing_required_parameter")
        arguments = _object(arguments, f"{path}.input")
        caller = optional_object(raw, "caller", f"{path}.caller")
        if caller is not None and caller.get("type") != "direct":
            raise cannot_provide(f"{path}.caller", "programmatic tool callers (code execution)")
        if raw.get("toolset_name") is not None:
            raise cannot_provide(f"{path}.toolset_name", "toolsets")
        # A frontier inside the assistant's tool-call markup is not a rendered message boundary.
        self._slot(raw, path, None)
        return ToolCall(name=name, arguments=arguments, call_id=call_id)

    def _tool_result(self, turn: _Turn, raw: dict, path: str) -> None:
        if turn.content_before_result is not None:
            raise invalid(
                path,
                f"{path}: tool_result blocks must come before other content in a user turn "
                f"({turn.content_before_result} precedes it)",
            )
        call_id = required_str(raw, "tool_use_id", f"{path}.tool_use_id")
        if raw.get("toolset_name") is not None:
            raise cannot_provide(f"{path}.toolset_name", "toolsets")
        is_error = optional_bool(raw, "is_error", f"{path}.is_error")
        parts: list[TextPart] = [TextPart(TOOL_ERROR_MARKER)] if is_error else []
        content = raw.get("content")
        if isinstance(content, str):
            parts.append(TextPart(content))
        elif isinstance(content, list):
            for j, block in enumerate(content):
                block_path = f"{path}.content[{j}]"
                block = _object(block, block_path)
                kind = required_str(block, "type", f"{block_path}.type")
                if kind == "text":
                    parts.append(self._text(block, block_path, targetable=False))
                elif kind == "image":
                    raise _vision_disabled(block_path)
                elif kind in _UNSUPPORTED_BLOCKS:
                    raise cannot_provide(block_path, _UNSUPPORTED_BLOCKS[kind])
                else:
                    raise invalid(f"{block_path}.type", f"{block_path}.type must be text or image, got {kind!r}")
        elif content is not None:
            raise wrong_type(f"{path}.content", "a string or an array of content blocks", content)
        message = Message(role="tool", content=parts, tool_call_id=call_id)

        def mark() -> None:
            # The result's frontier is the end of its rendered text; an empty part marks an empty result.
            if not message.content:
                message.content.append(TextPart(""))
            message.content[-1].cache_breakpoint = True

        self._slot(raw, path, mark)
        turn.results.append((call_id, message, path))

    def _slot(self, raw: dict, path: str, mark: Callable[[], None] | None, *, targetable: bool = True) -> None:
        marker = raw.get("cache_control")
        ttl = None
        if marker is not None:
            marker = _object(marker, f"{path}.cache_control")
            if marker.get("type") != "ephemeral":
                raise invalid(f"{path}.cache_control.type", f"{path}.cache_control.type must be ephemeral")
            ttl = _cache_ttl(marker, f"{path}.cache_control.ttl")
        self.slots.append(_CacheSlot(path, ttl, mark, targetable))

    # -- tool pairing -----------------------------------------------------------------------

    def _pair_tool_results(self, turns: list[_Turn]) -> list[Message]:
        """Each visible tool_use turn is answered by exactly one leading result per id in the next
        User turn; results are put in call order. Results opening the history need no calls."""
        messages: list[Message] = []
        pending: _Turn | None = None  # the last Assistant turn with calls, until its results arrive
        opened = False  # a User or Assistant turn was seen (results can no longer open the history)
        for turn in turns:
            if turn.role == "system":
                messages.append(Message(role="system", content=turn.parts))
                continue
            if turn.role == "assistant":
                if pending is not None:
                    raise _missing_results(pending, [c.call_id for c in pending.calls], turn.path)
                reasoning = "".join(turn.thinking) if turn.thinking else None
                messages.append(
                    Message(role="assistant", content=turn.parts, reasoning=reasoning, tool_calls=turn.calls)
                )
                _check_unique_ids(turn)
                pending = turn if turn.calls else None
            else:
                results = (
                    _ordered_results(turn, pending) if pending is not None else self._opening_results(turn, opened)
                )
                messages += results
                if turn.parts or not results:
                    messages.append(Message(role="user", content=turn.parts))
                pending = None
            opened = True
        if pending is not None:
            raise _missing_results(pending, [c.call_id for c in pending.calls], None)
        return messages

    @staticmethod
    def _opening_results(turn: _Turn, opened: bool) -> list[Message]:
        if not turn.results:
            return []
        call_id, _, path = turn.results[0]
        if opened:
            raise invalid(path, f"{path}: tool_result {call_id!r} has no tool_use in the preceding assistant turn")
        seen: set[str] = set()
        for call_id, _, path in turn.results:
            if call_id in seen:
                raise invalid(f"{path}.tool_use_id", f"{path}: a second tool_result for {call_id!r}")
            seen.add(call_id)
        return [message for _, message, _ in turn.results]

    # -- cache markers ----------------------------------------------------------------------

    def apply_cache_markers(self, body: dict) -> None:
        """Block markers (at most four) plus the request-level marker on the last cacheable block."""
        explicit = [slot for slot in self.slots if slot.ttl is not None]
        if len(explicit) > MAX_CACHE_BREAKPOINTS:
            raise invalid(
                "cache_control",
                f"at most {MAX_CACHE_BREAKPOINTS} blocks may carry cache_control; found {len(explicit)}",
            )
        marker = optional_object(body, "cache_control", "cache_control")
        if marker is not None:
            if marker.get("type") != "ephemeral":
                raise invalid("cache_control.type", "cache_control.type must be ephemeral")
            ttl = _cache_ttl(marker, "cache_control.ttl")
            target = next((slot for slot in reversed(self.slots) if slot.targetable), None)
            if target is not None and target.ttl != ttl:
                if target.ttl is not None:
                    raise invalid(
                        "cache_control",
                        f"cache_control (ttl {ttl}) targets {target.path}, which already "
                        f"carries a cache_control with ttl {target.ttl}",
                    )
                if len(explicit) >= MAX_CACHE_BREAKPOINTS:
                    raise invalid(
                        "cache_control",
                        f"cache_control needs a fifth breakpoint slot: {target.path} is not "
                        f"one of the {len(explicit)} block-level breakpoints",
                    )
                target.ttl = ttl
        for slot in self.slots:
            if slot.ttl is not None and slot.mark is not None:
                slot.mark()


def _cache_ttl(marker: dict, path: str) -> str:
    ttl = marker.get("ttl")
    if ttl is None:
        return "5m"
    if ttl not in CACHE_TTLS:
        raise invalid(path, f"{path} must be 5m or 1h, got {ttl!r}")
    return ttl


def _is_billing_header(block: Any) -> bool:
    return (
        isinstance(block, dict)
        and block.get("type") == "text"
        and isinstance(block.get("text"), str)
        and block["text"].startswith(BILLING_HEADER_PREFIX)
    )


def _vision_disabled(path: str) -> APIError:
    return APIError(
        400, f"{path}: image input needs Vision, which this server does not provide", code="vision_disabled", param=path
    )


def _join(previous: _Turn, turn: _Turn) -> None:
    """Append a consecutive same-role turn: blocks are concatenated without separators."""
    if turn.results and previous.content_before_result is not None:
        _, _, path = turn.results[0]
        raise invalid(path, f"{path}: tool_result blocks must come before other content in the joined user turn")
    if previous.content_before_result is None:
        previous.content_before_result = turn.content_before_result
    previous.parts += turn.parts
    previous.thinking += turn.thinking
    previous.calls += turn.calls
    previous.call_paths += turn.call_paths
    previous.results += turn.results


def _check_unique_ids(turn: _Turn) -> None:
    seen: set[str] = set()
    for call, path in zip(turn.calls, turn.call_paths):
        if call.call_id in seen:
            raise invalid(f"{path}.id", f"{path}.id {call.call_id!r} is used twice in one assistant turn")
        seen.add(call.call_id)


def _ordered_results(turn: _Turn, calls_turn: _Turn) -> list[Message]:
    declared = [call.call_id for call in calls_turn.calls]
    by_id: dict[str, Message] = {}
    for call_id, message, path in turn.results:
        if call_id not in declared:
            raise invalid(
                f"{path}.tool_use_id",
                f"{path}: tool_result {call_id!r} answers no tool_use of the preceding assistant turn",
            )
        if call_id in by_id:
            raise invalid(f"{path}.tool_use_id", f"{path}: a second tool_result for {call_id!r}")
        by_id[call_id] = message
    missing = [call_id for call_id in declared if call_id not in by_id]
    if missing:
        raise _missing_results(calls_turn, missing, turn.path)
    return [by_id[call_id] for call_id in declared]


def _missing_results(calls_turn: _Turn, missing: list[str | None], where: str | None) -> APIError:
    ids = ", ".join(repr(call_id) for call_id in missing)
    after = f"; {where} does not provide them" if where else ""
    return invalid(
        calls_turn.path,
        f"{calls_turn.path}: tool_use ids {ids} need one leading tool_result each in the next user turn{after}",
    )
