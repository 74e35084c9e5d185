"""ResponsesRequest: a Responses create (or input_tokens) body validated into normalized Items,
function identities and generation options.

Every create field is mapped, accepted as advisory, or rejected with a field-specific APIError;
unknown top-level fields are unknown_parameter. Items are parsed in items.py, tools in
tools.py; the Item history becomes a prompt in history.py.

Compatibility rules for agent clients (Codex sends these on every request):
- `include: ["reasoning.encrypted_content"]` returns each reasoning Item's text again inside
  a reversible envelope as encrypted_content, which round-trips when the client replays it;
- `text.verbosity` low or high is accepted as a hint (echoed; the model has no verbosity switch);
- hosted tools offered without being forced are left out of the prompt (tools.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ninfer.contract.sampling import SamplingOverrides
from ninfer.frontend.capabilities import EFFORT_TIERS, TemplateCapabilities
from ninfer.frontend.answer_format import AnswerFormat, JsonAnswer
from ninfer.frontend.conversation import Tool
from ninfer.server.errors import APIError, invalid
from ninfer.server.openai_responses.items import parse_input
from ninfer.server.openai_responses.tools import FunctionRef, parse_tools
from ninfer.server.request_context import RequestContext
from ninfer.server.validation.cache_markers import check_advisory_cache_fields, implicit_candidate
from ninfer.server.validation.fields import (
    cannot_provide,
    enum_value,
    object_body,
    optional_bool,
    optional_int,
    optional_list,
    optional_number,
    optional_object,
    optional_str,
    required_str,
    wrong_type,
)
from ninfer.server.validation.structured_output import answer_format, json_format
from ninfer.server.validation.thinking import (
    check_preserve_thinking,
    check_template_kwargs,
    exact_effort,
    template_option,
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
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast", "ultrafast")
ENCRYPTED_REASONING = "reasoning.encrypted_content"
OUTPUT_LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (ENCRYPTED_REASONING, OUTPUT_LOGPROBS)


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
    omitted_hosted_tools: list[str] = field(default_factory=list)
    max_output_tokens: int | None = None  # None: --default-max-tokens
    stream: bool = False
    store: bool = True
    include_encrypted_reasoning: bool = False
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)
    answer: AnswerFormat | None = None  # text.format json / forced or strict tool calls
    top_logprobs: int | None = None  # answer-token log probabilities (include or top_logprobs); None: none
    echo: dict[str, Any] = field(default_factory=dict)  # request configuration the Response repeats


def parse_create(body: Any, context: RequestContext) -> ResponsesRequest:
    """Validate a POST /v1/responses body; raises APIError naming the offending field."""
    return _parse(body, context, CREATE_FIELDS, model_required=True)


def parse_input_tokens(body: Any, context: RequestContext) -> ResponsesRequest:
    """Validate a POST /v1/responses/input_tokens body (the prompt-shaping subset of create)."""
    return _parse(body, context, COUNT_FIELDS, model_required=False)


def _parse(body: Any, context: RequestContext, allowed: frozenset[str], model_required: bool) -> ResponsesRequest:
    body = object_body(body)
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
    items, paths = parse_input(body.get("input"), previous is not None, context.vision_enabled)
    instructions = optional_str(body, "instructions", "instructions")
    tools = parse_tools(body)
    thinking, reasoning_echo = _thinking(body, context.capabilities)
    text, json_answer = _text_config(body)
    _check_truncation(body)
    request = ResponsesRequest(
        items=items,
        item_paths=paths,
        instructions=instructions,
        previous_response_id=previous,
        tools=tools.tools,
        functions=tools.functions,
        callable_tools=tools.callable,
        omitted_hosted_tools=tools.omitted_hosted,
        enable_thinking=thinking[0],
        template_effort=thinking[1],
        preserve_thinking=thinking[2],
        implicit_cache_breakpoint=True,
        answer=answer_format(
            json_answer, tools.declared, list(tools.callable), tools.choice,
            parallel=body.get("parallel_tool_calls") is not False,
        ),
    )
    request.echo = {
        "model": model,
        "instructions": instructions,
        "previous_response_id": previous,
        "reasoning": reasoning_echo,
        "text": text,
        "tools": tools.echo,
        "tool_choice": tools.choice_echo,
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
    tier = enum_value(body, "service_tier", "service_tier", SERVICE_TIERS)
    if tier not in (None, "auto", "default"):
        raise cannot_provide("service_tier", f"the {tier} service tier (only auto or default)")
    if optional_bool(body, "background", "background"):
        raise cannot_provide("background", "background execution")
    include = _include(body)
    request.include_encrypted_reasoning = ENCRYPTED_REASONING in include
    if OUTPUT_LOGPROBS in include or top_logprobs:
        request.top_logprobs = top_logprobs or 0
    stream_options = optional_object(body, "stream_options", "stream_options") or {}
    # Advisory: this local server never pads deltas, so there is nothing to switch off.
    optional_bool(stream_options, "include_obfuscation", "stream_options.include_obfuscation")
    client_metadata = body.get("client_metadata")
    if client_metadata is not None and not isinstance(client_metadata, dict):
        raise wrong_type("client_metadata", "an object or null", client_metadata)
    for key in ("safety_identifier", "user"):
        optional_str(body, key, key)
    retention = check_advisory_cache_fields(body)
    request.implicit_cache_breakpoint = implicit_candidate(body)
    request.echo.update(
        {
            "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": max_tool_calls,
            "metadata": _metadata(body),
            "store": request.store,
            "background": False,
            "service_tier": "default",
            "top_logprobs": top_logprobs or 0,
            "prompt_cache_key": body.get("prompt_cache_key"),
            "prompt_cache_retention": retention,
            "safety_identifier": body.get("safety_identifier"),
            "user": body.get("user"),
        }
    )


def _include(body: dict) -> set[str]:
    include = optional_list(body, "include", "include") or []
    for i, value in enumerate(include):
        if not isinstance(value, str):
            raise wrong_type(f"include[{i}]", "a string", value)
    others = [value for value in include if value not in INCLUDABLE]
    if others:
        raise cannot_provide("include", f"additional output data ({', '.join(others)})")
    return set(include)


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


def _text_config(body: dict) -> tuple[dict[str, Any], JsonAnswer | None]:
    """The text echo and the JSON answer text.format asks for (None: plain text)."""
    text = optional_object(body, "text", "text") or {}
    fmt = optional_object(text, "format", "text.format")
    json_answer = json_format(fmt, "text.format", nested=False)
    echo: dict[str, Any] = {"format": fmt if json_answer is not None else {"type": "text"}}
    verbosity = enum_value(text, "verbosity", "text.verbosity", ("low", "medium", "high"))
    if verbosity is not None:
        echo["verbosity"] = verbosity  # a hint (module docstring)
    return echo, json_answer


def _check_truncation(body: dict) -> None:
    truncation = enum_value(body, "truncation", "truncation", ("auto", "disabled"))
    if truncation == "auto":
        raise cannot_provide("truncation", "automatic truncation (overlong input fails instead of dropping Items)")


def _thinking(body: dict, caps: TemplateCapabilities) -> tuple[tuple[bool | None, str | None, bool | None], dict]:
    """(enable_thinking, template effort, preserve_thinking) and the reasoning echo."""
    reasoning = optional_object(body, "reasoning", "reasoning") or {}
    effort = enum_value(reasoning, "effort", "reasoning.effort", EFFORT_TIERS)
    summary = enum_value(reasoning, "summary", "reasoning.summary", ("auto", "concise", "detailed"))
    legacy = enum_value(reasoning, "generate_summary", "reasoning.generate_summary", ("auto", "concise", "detailed"))
    for key, value in (("summary", summary), ("generate_summary", legacy)):
        # "auto" lets the server decide, and NInfer has no summarizer; an explicit style cannot be met.
        if value in ("concise", "detailed"):
            raise cannot_provide(f"reasoning.{key}", f"{value} reasoning summaries (raw reasoning text is returned)")
    context = enum_value(reasoning, "context", "reasoning.context", ("auto", "current_turn", "all_turns"))
    if context not in (None, "auto"):
        raise cannot_provide("reasoning.context", "reasoning-context selection (use preserve_thinking)")
    mode = optional_str(reasoning, "mode", "reasoning.mode")
    if mode not in (None, "standard"):
        raise cannot_provide("reasoning.mode", f"the {mode} reasoning mode")
    enable = template_effort = None
    if effort is not None:
        enable, template_effort = exact_effort("reasoning.effort", effort, caps)
    kwargs = optional_object(body, "chat_template_kwargs", "chat_template_kwargs") or {}
    check_template_kwargs(kwargs, ("preserve_thinking",))
    preserve, source = template_option(body, kwargs, "preserve_thinking")
    preserve = check_preserve_thinking(preserve, source, caps)
    return (enable, template_effort, preserve), {"effort": effort, "summary": summary}
