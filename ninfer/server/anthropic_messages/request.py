"""MessagesRequest: an Anthropic Messages body validated into a Conversation and generation options.

Top-level fields, thinking and effort, sampling and tool choice live here; blocks and their
lowering into the prompt live in lowering.py. Capabilities the engine cannot provide are
rejected with the missing capability named; advisory and unknown fields are ignored.

Compatibility rules for agent clients (Claude Code sends these on every request):
- output_config.effort maps to the template's nearest tier, or plain thinking where it has
  no tiers (validation/thinking.py);
- thinking enabled or adaptive on a template that cannot think is served without thinking;
- thinking.display "omitted" is served: thinking blocks carry empty text and a signature that
  holds the reasoning in NInfer's reversible envelope, so replaying them rebuilds the prompt.
Each mapping is reported in the server log.

PROMPT_FIELDS (create and count_tokens) and CREATE_FIELDS declare every top-level field once:
the OpenAPI document's request schemas are rendered from them (schema.py), and the plain ones are
read through them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ninfer.contract.sampling import TOP_K_CAP, SamplingOverrides
from ninfer.frontend.capabilities import TemplateCapabilities
from ninfer.frontend.conversation import Conversation
from ninfer.server.anthropic_messages.lowering import Lowering
from ninfer.server.endpoint import ParsedRequest
from ninfer.server.errors import invalid
from ninfer.server.generation import GenerationOptions
from ninfer.server.request_context import RequestContext
from ninfer.server.validation.fields import (
    Field,
    Fields,
    cannot_provide,
    is_int,
    object_body,
    optional_bool,
    optional_list,
    optional_object,
    optional_str,
    require_object,
    required_str,
    wrong_type,
)
from ninfer.server.validation.sampling import stop_field
from ninfer.server.validation.schema import EMPTY, NON_EMPTY_STRING, STRING, const, integer, obj, ref, unprovidable
from ninfer.server.validation.thinking import check_preserve_thinking, nearest_effort, thinking_reachable
from ninfer.server.validation.structured_output import (
    DeclaredTool,
    ToolChoice,
    answer_format,
    json_format,
    tool_strict,
)
from ninfer.server.validation.tools import check_template_renders_tools

MIN_THINKING_BUDGET = 1024
EFFORTS = ("low", "medium", "high", "xhigh", "max")
# Top-level fields that ask for an executor NInfer does not have.
UNSUPPORTED_FIELDS = {
    "container": "containers",
    "mcp_servers": "MCP servers",
}
OUTPUT_CONFIG = Fields(
    {
        "effort": Field.choice(EFFORTS, "served as the template's nearest tier"),
        "format": Field.object(ref("MessagesOutputFormat")),
    },
    "output_config",
)
# The prompt-shaping fields, which count_tokens takes too.
PROMPT_FIELDS = Fields(
    {
        "model": Field.shape({**NON_EMPTY_STRING, "description": "any non-empty label; echoed back, selects nothing"}),
        "messages": Field.shape({
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [ref("UserMessage"), ref("AssistantMessage"), ref("SystemMessage")]},
        }),
        "system": Field.shape({"anyOf": [STRING, {"type": "array", "items": ref("TextBlock")}]}),
        "tools": Field.shape({"type": "array", "items": ref("MessagesTool")}),
        "tool_choice": Field.shape(ref("MessagesToolChoice")),
        "thinking": Field.object(ref("MessagesThinking")),
        "output_config": OUTPUT_CONFIG.member(),
        "preserve_thinking": Field.boolean(),
        "cache_control": Field.shape(ref("CacheControl")),
        "context_management": Field.shape(obj({
            "edits": {
                "type": "array",
                "items": unprovidable(
                    obj({"type": const("clear_thinking_20251015"), "keep": const("all")}, ("type", "keep")),
                    "server-side context editing",
                ),
            }
        })),
        "output_format": Field.object(
            {**ref("MessagesOutputFormat"), "description": "the beta spelling of output_config.format"}
        ),
        **{key: Field.shape(unprovidable(EMPTY, capability)) for key, capability in UNSUPPORTED_FIELDS.items()},
    }
)
# The output-only fields of a create: count_tokens does not read them.
CREATE_FIELDS = Fields(
    {
        **PROMPT_FIELDS,
        "max_tokens": Field.shape({**integer(1), "description": "default --default-max-tokens"}),
        "stop_sequences": stop_field(),
        "stream": Field.boolean(),
        "temperature": Field.number(0, 1),
        "top_p": Field.number(0, 1),
        "top_k": Field.shape(unprovidable(integer(0, TOP_K_CAP), f"top_k above {TOP_K_CAP}")),
        "metadata": Field.shape({
            "type": "object",
            "properties": {"user_id": {"anyOf": [STRING, {"type": "null"}],
                                       "description": "the conversation's routing key (ninfer-routing-key header)"}},
        }),  # fmt: skip
    }
)


@dataclass
class MessagesRequest(ParsedRequest):
    model: str = ""  # the client's label, echoed in the response
    thinking_omitted: bool = False  # thinking.display "omitted": text travels in the signature only
    notes: list[str] = field(default_factory=list)  # compatibility mappings applied, for the log

    @property
    def requested_effort(self) -> str | None:
        """output_config.effort as given."""
        return self.requested_reasoning_effort

    @property
    def max_tokens(self) -> int:
        return self.options.max_tokens

    @property
    def sampling(self) -> SamplingOverrides:
        return self.options.sampling

    @property
    def stop_sequences(self) -> list[str]:
        return self.options.stop

    @property
    def callable_tools(self) -> dict[str, dict | None] | None:
        return self.options.tools

    @property
    def thinking_budget(self) -> int | None:
        return self.options.thinking_budget


def parse_messages_request(body: Any, context: RequestContext, *, count_only: bool = False) -> MessagesRequest:
    """Validate a parsed JSON body; raises APIError naming the offending field.

    count_only: the count_tokens body, whose output-only fields (max_tokens, sampling, stop
    sequences, stream) neither are required nor affect the prompt, so they are not read.
    """
    body = object_body(body)
    model = required_str(body, "model", "model")
    if not model:
        raise invalid("model", "model must be a non-empty string")
    _reject_unprovidable_fields(body)
    caps = context.capabilities
    if count_only:
        options = GenerationOptions(max_tokens=context.default_max_tokens)
        stream = False
    else:
        options = GenerationOptions(
            max_tokens=_max_tokens(body, context.default_max_tokens),
            sampling=_sampling(body),
            stop=CREATE_FIELDS.read(body, "stop_sequences"),
        )
        stream = bool(CREATE_FIELDS.read(body, "stream"))
    notes: list[str] = []
    thinking = _Thinking.parse(body, caps, None if count_only else options.max_tokens, notes)
    effort = _effort(body, caps, notes)
    preserve = check_preserve_thinking(PROMPT_FIELDS.read(body, "preserve_thinking"), None, caps)

    lowering = Lowering(context.vision_enabled)
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
    check_template_renders_tools(conversation, caps, "tools" if tools else "messages")
    options.tools, choice, parallel = _callable_tools(body, schemas)
    options.answer = answer_format(
        _json_answer(body), _declared_tools(body, schemas), list(options.tools or {}), choice, parallel,
    )
    if prefill and options.answer is not None:
        raise cannot_provide(
            "messages", "an assistant prefill under an output format or a forced tool (the grammar starts the answer)"
        )
    options.thinking_budget = thinking.budget
    return MessagesRequest(
        conversation=conversation,
        options=options,
        stream=stream,
        model=model,
        requested_reasoning_effort=(PROMPT_FIELDS.read(body, "output_config") or {}).get("effort"),
        thinking_omitted=thinking.omitted,
        notes=notes,
        routing_key=None if count_only else _routing_key(body),
    )


def _routing_key(body: dict) -> str | None:
    """metadata.user_id: Claude Code's carries its session, the key a router keeps it on."""
    metadata = optional_object(body, "metadata", "metadata")
    user_id = (metadata or {}).get("user_id")
    if user_id is not None and not isinstance(user_id, str):
        raise wrong_type("metadata.user_id", "a string", user_id)
    return user_id or None


def _reject_unprovidable_fields(body: dict) -> None:
    for key, capability in UNSUPPORTED_FIELDS.items():
        if body.get(key) not in (None, [], {}):
            raise cannot_provide(key, capability)
    _check_context_management(body)


def _json_answer(body: dict):
    """Structured Outputs: output_config.format, or the beta's top-level output_format."""
    fmt = OUTPUT_CONFIG.read(PROMPT_FIELDS.read(body, "output_config") or {}, "format")
    path = "output_config.format"
    if fmt is None:
        fmt, path = PROMPT_FIELDS.read(body, "output_format"), "output_format"
    return json_format(fmt, path, nested=False, kinds=("json_schema",))


def _declared_tools(body: dict, schemas: dict[str, dict]) -> list[DeclaredTool]:
    """The declared tools with their strict flags (lowering.py has checked their shapes)."""
    declared = []
    for i, raw in enumerate(optional_list(body, "tools", "tools") or []):
        name = raw.get("name")
        if name in schemas:
            strict = tool_strict(raw, f"tools[{i}]")
            declared.append(DeclaredTool(name, schemas[name], f"tools[{i}].input_schema", strict))
    return declared


def _check_context_management(body: dict) -> None:
    """Only the no-op edit passes: Claude Code sends clear_thinking with keep "all" on every request."""
    config = optional_object(body, "context_management", "context_management") or {}
    edits = optional_list(config, "edits", "context_management.edits") or []
    for i, edit in enumerate(edits):
        path = f"context_management.edits[{i}]"
        edit = require_object(edit, path)
        if edit.get("type") != "clear_thinking_20251015" or edit.get("keep") != "all":
            raise cannot_provide(path, f"server-side context editing ({edit.get('type')!r} that removes context)")


def _max_tokens(body: dict, default: int) -> int:
    value = body.get("max_tokens")
    if value is None:
        return default
    if not is_int(value):
        raise wrong_type("max_tokens", "an integer", value)
    value = int(value)
    if value == 0:
        raise cannot_provide("max_tokens", "max_tokens 0 (a completed zero-output cache-prewarm lifecycle)")
    if value < 0:
        raise invalid("max_tokens", f"max_tokens must be a positive integer, got {value}")
    return value


def _sampling(body: dict) -> SamplingOverrides:
    top_k = body.get("top_k")
    if top_k is not None:
        if not is_int(top_k):
            raise wrong_type("top_k", "an integer", top_k)
        top_k = int(top_k)
        if top_k < 0:
            raise invalid("top_k", f"top_k must be a non-negative integer, got {top_k}")
        if top_k > TOP_K_CAP:
            raise cannot_provide("top_k", f"top_k above {TOP_K_CAP} (the sampler's candidate cap)")
    return SamplingOverrides(
        temperature=CREATE_FIELDS.read(body, "temperature"), top_p=CREATE_FIELDS.read(body, "top_p"), top_k=top_k
    )


def _effort(body: dict, caps: TemplateCapabilities, notes: list[str]) -> str | None:
    effort = OUTPUT_CONFIG.read(PROMPT_FIELDS.read(body, "output_config") or {}, "effort")
    if effort is None:
        return None
    return nearest_effort("output_config.effort", effort, caps, notes)


@dataclass
class _Thinking:
    enable: bool | None = None  # None: the server/template default
    budget: int | None = None
    omitted: bool = False

    @classmethod
    def parse(cls, body: dict, caps: TemplateCapabilities, max_tokens: int | None, notes: list[str]) -> _Thinking:
        raw = PROMPT_FIELDS.read(body, "thinking")
        if raw is None:
            return cls()
        kind = required_str(raw, "type", "thinking.type")
        if kind == "disabled":
            if not thinking_reachable(caps, False):
                raise cannot_provide("thinking", "disabling thinking (the loaded chat template has no thinking switch)")
            return cls(enable=False)
        if kind == "between_tools":
            raise cannot_provide("thinking.type", "thinking restricted to between tool calls")
        if kind not in ("enabled", "adaptive"):
            raise invalid("thinking.type", f"thinking.type must be enabled, adaptive or disabled, got {kind!r}")
        display = optional_str(raw, "display", "thinking.display")
        if display not in (None, "summarized", "omitted"):
            raise invalid("thinking.display", f"thinking.display must be summarized or omitted, got {display!r}")
        budget = _budget(raw, max_tokens) if kind == "enabled" else None
        if not thinking_reachable(caps, True):
            notes.append(f"thinking {kind!r} served without thinking (the template cannot think)")
            return cls()
        return cls(enable=True, budget=budget, omitted=display == "omitted")


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
    budget = int(budget)
    if budget < MIN_THINKING_BUDGET:
        raise invalid(
            "thinking.budget_tokens", f"thinking.budget_tokens must be >= {MIN_THINKING_BUDGET}, got {budget}"
        )
    if max_tokens is not None and budget >= max_tokens:
        raise invalid(
            "thinking.budget_tokens", f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})"
        )
    return budget


def _callable_tools(body: dict, schemas: dict[str, dict]) -> tuple[dict[str, dict | None] | None, ToolChoice, bool]:
    """The decoder's callable set (every declared tool, the named one under `tool`, nothing under
    none), the choice (`any` requires a call) and whether parallel calls are allowed."""
    choice = body.get("tool_choice")
    if choice is None:
        return dict(schemas) or None, ToolChoice("auto"), True
    choice = require_object(choice, "tool_choice")
    kind = required_str(choice, "type", "tool_choice.type")
    if kind not in ("auto", "any", "tool", "none"):
        raise invalid("tool_choice.type", f"tool_choice.type must be auto, any, tool or none, got {kind!r}")
    if kind == "none":
        return None, ToolChoice("none"), True  # the tools stay in the prompt; markup stays text
    disable_parallel = optional_bool(choice, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use")
    parallel = not disable_parallel
    if kind == "tool":
        name = required_str(choice, "name", "tool_choice.name")
        if name not in schemas:
            raise invalid("tool_choice.name", f"tool_choice.name {name!r} is not a declared tool")
        return {name: schemas[name]}, ToolChoice("named", name), False
    return dict(schemas) or None, ToolChoice("required" if kind == "any" else "auto"), parallel
