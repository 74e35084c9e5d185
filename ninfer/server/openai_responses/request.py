"""ResponsesRequest: a Responses create (or input_tokens) body validated into normalized Items,
function identities and generation options.

Every create field is mapped, accepted as advisory, or rejected with a field-specific APIError;
unknown top-level fields are unknown_parameter. Items are parsed in items.py, tools in
tools.py; the Item history becomes a prompt in history.py.

CREATE_FIELDS and COUNT_FIELDS declare every top-level field once: the OpenAPI document's request
schemas are rendered from them (schema.py), the plain ones are read through them, and any other
field is unknown_parameter.

Compatibility rules for agent clients (Codex sends these on every request):
- `include: ["reasoning.encrypted_content"]` returns each reasoning Item's text again inside
  a reversible envelope as encrypted_content, which round-trips when the client replays it;
- `text.verbosity` low or high is accepted as a hint (echoed; the model has no verbosity switch);
- hosted tools offered without being forced are left out of the prompt (tools.py).
"""

from __future__ import annotations

import functools
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
from ninfer.server.validation.cache_markers import CACHE_HINTS, check_advisory_cache_fields, implicit_candidate
from ninfer.server.validation.fields import (
    Field,
    Fields,
    cannot_provide,
    object_body,
    optional_bool,
    optional_list,
    optional_object,
    optional_str,
    required_str,
    wrong_type,
)
from ninfer.server.validation.sampling import OPENAI_SAMPLING
from ninfer.server.validation.schema import (
    BOOLEAN,
    EMPTY,
    NON_EMPTY_STRING,
    OBJECT,
    STRING,
    const,
    enum,
    obj,
    ref,
    unprovidable,
)
from ninfer.server.validation.structured_output import answer_format, json_format
from ninfer.server.validation.thinking import (
    check_preserve_thinking,
    check_template_kwargs,
    exact_effort,
    template_option,
)

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
SUMMARY_STYLES = ("auto", "concise", "detailed")

REASONING = Fields(
    {
        "effort": Field.choice(EFFORT_TIERS, "must be a tier the loaded template exposes (or none)"),
        "summary": Field.choice(SUMMARY_STYLES, served=("auto",), refusal="concise or detailed summaries"),
        "generate_summary": Field.choice(SUMMARY_STYLES, served=("auto",), refusal="concise or detailed summaries"),
        "context": Field.choice(("auto", "current_turn", "all_turns"), served=("auto",),
                                refusal="reasoning-context selection"),
        "mode": Field(unprovidable(const("standard"), "other reasoning modes"), optional_str),
    },
    "reasoning",
)
TEXT = Fields(
    {
        "format": Field.shape({
            "anyOf": [
                obj({"type": enum(("text", "json_object"))}, ("type",)),
                obj(
                    {"type": const("json_schema"), "name": NON_EMPTY_STRING, "description": STRING,
                     "schema": ref("JsonSchema"), "strict": BOOLEAN},
                    ("type", "schema"),
                    description="the schema is enforced whatever strict says",
                ),
            ]
        }),
        "verbosity": Field.choice(("low", "medium", "high"), "a hint, echoed"),
    },
    "text",
)
STREAM_OPTIONS = Fields({"include_obfuscation": Field.boolean()}, "stream_options")


def _unprovidable(*keys: str) -> dict[str, Field]:
    return {key: Field.shape(unprovidable(EMPTY, UNPROVIDABLE_FIELDS[key])) for key in keys}


# The prompt-shaping fields, which POST /v1/responses/input_tokens takes too.
PROMPT_FIELDS = Fields({
    "model": Field.shape(ref("ModelId")),
    "input": Field.shape({
        "anyOf": [STRING, {"type": "array", "items": ref("InputItem")}],
        "description": "Required (non-empty) unless previous_response_id supplies the conversation.",
    }),
    "instructions": Field.string(),
    "previous_response_id": Field.shape(
        {**NON_EMPTY_STRING, "description": "a stored Response (404 response_not_found otherwise)"}
    ),
    "reasoning": Field.object(ref("ResponsesReasoning")),
    "tools": Field.shape({"type": "array", "items": ref("ResponsesTool")}),
    "tool_choice": Field.shape(ref("ResponsesToolChoice")),
    "parallel_tool_calls": Field.boolean("false: at most one call (a grammar)"),
    "text": Field.object(ref("ResponsesText")),
    "truncation": Field.choice(("auto", "disabled"), served=("disabled",), refusal="automatic truncation"),
    "preserve_thinking": Field.boolean(),
    "chat_template_kwargs": Field.shape(ref("ResponsesTemplateKwargs")),
})
CREATE_FIELDS = Fields(
    {
        **PROMPT_FIELDS,
        "max_output_tokens": Field.integer(0),
        "stream": Field.boolean(),
        "store": Field.boolean("default true; stored in this process only"),
        "temperature": OPENAI_SAMPLING["temperature"],
        "top_p": OPENAI_SAMPLING["top_p"],
        "metadata": Field.shape({
            "type": "object",
            "maxProperties": MAX_METADATA_PAIRS,
            "propertyNames": {"maxLength": MAX_METADATA_KEY},
            "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
        }),
        "client_metadata": Field.shape(OBJECT),
        "max_tool_calls": Field.integer(0),
        "top_logprobs": Field.integer(0, 20, "alternatives per answer token; log probabilities are returned with "
                                             "it, or with include message.output_text.logprobs"),
        "service_tier": Field.choice(SERVICE_TIERS, served=("auto", "default"), refusal="other service tiers"),
        "background": Field(unprovidable(const(False), "background execution"), optional_bool),
        "include": Field.shape({"type": "array", "items": unprovidable(enum(INCLUDABLE), "other data")}),
        "stream_options": STREAM_OPTIONS.member(),
        **CACHE_HINTS,
        "safety_identifier": Field.string(),
        "user": Field.string(),
        # Recognised features NInfer cannot provide: rejected by name when they ask for something.
        **_unprovidable("conversation", "prompt", "context_management", "moderation", "background_options",
                        "access_programs", "image"),
    }
)
COUNT_FIELDS = Fields({**PROMPT_FIELDS, **_unprovidable("conversation", "personality")})


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


def _parse(body: Any, context: RequestContext, allowed: Fields, model_required: bool) -> ResponsesRequest:
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
    instructions = PROMPT_FIELDS.read(body, "instructions")
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
    read = functools.partial(CREATE_FIELDS.read, body)
    request.max_output_tokens = read("max_output_tokens")
    request.stream = bool(read("stream"))
    request.store = read("store") is not False
    request.sampling = SamplingOverrides(temperature=read("temperature"), top_p=read("top_p"))
    max_tool_calls = read("max_tool_calls")  # hosted-tool limit: nothing to execute here
    top_logprobs = read("top_logprobs")
    tier = read("service_tier")
    if tier not in (None, "auto", "default"):
        raise cannot_provide("service_tier", f"the {tier} service tier (only auto or default)")
    if read("background"):
        raise cannot_provide("background", "background execution")
    include = _include(body)
    request.include_encrypted_reasoning = ENCRYPTED_REASONING in include
    if OUTPUT_LOGPROBS in include or top_logprobs:
        request.top_logprobs = top_logprobs or 0
    # Advisory: this local server never pads deltas, so there is nothing to switch off.
    STREAM_OPTIONS.read(read("stream_options") or {}, "include_obfuscation")
    client_metadata = body.get("client_metadata")
    if client_metadata is not None and not isinstance(client_metadata, dict):
        raise wrong_type("client_metadata", "an object or null", client_metadata)
    for key in ("safety_identifier", "user"):
        read(key)
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
    text = PROMPT_FIELDS.read(body, "text") or {}
    fmt = optional_object(text, "format", "text.format")
    json_answer = json_format(fmt, "text.format", nested=False)
    echo: dict[str, Any] = {"format": fmt if json_answer is not None else {"type": "text"}}
    verbosity = TEXT.read(text, "verbosity")
    if verbosity is not None:
        echo["verbosity"] = verbosity  # a hint (module docstring)
    return echo, json_answer


def _check_truncation(body: dict) -> None:
    truncation = PROMPT_FIELDS.read(body, "truncation")
    if truncation == "auto":
        raise cannot_provide("truncation", "automatic truncation (overlong input fails instead of dropping Items)")


def _thinking(body: dict, caps: TemplateCapabilities) -> tuple[tuple[bool | None, str | None, bool | None], dict]:
    """(enable_thinking, template effort, preserve_thinking) and the reasoning echo."""
    reasoning = PROMPT_FIELDS.read(body, "reasoning") or {}
    effort = REASONING.read(reasoning, "effort")
    summary = REASONING.read(reasoning, "summary")
    legacy = REASONING.read(reasoning, "generate_summary")
    for key, value in (("summary", summary), ("generate_summary", legacy)):
        # "auto" lets the server decide, and NInfer has no summarizer; an explicit style cannot be met.
        if value in ("concise", "detailed"):
            raise cannot_provide(f"reasoning.{key}", f"{value} reasoning summaries (raw reasoning text is returned)")
    context = REASONING.read(reasoning, "context")
    if context not in (None, "auto"):
        raise cannot_provide("reasoning.context", "reasoning-context selection (use preserve_thinking)")
    mode = REASONING.read(reasoning, "mode")
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
