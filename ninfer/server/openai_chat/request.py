"""ChatRequest: a Chat Completions body validated into a Conversation and generation options.

Every field the API names is mapped, accepted as neutral/advisory, or rejected with a
field-specific APIError; options whose behaviour the engine cannot provide are rejected only
when they actually request it. Unknown top-level fields are ignored. Messages are parsed in
messages.py; tools, cache markers, media, thinking and sampling rules are the shared ones.

FIELDS declares every top-level field once: the OpenAPI document's ChatCompletionRequest is
rendered from it (schema.py), and the plain ones are read through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ninfer.contract.sampling import SamplingOverrides
from ninfer.frontend.capabilities import EFFORT_TIERS
from ninfer.frontend.conversation import Conversation, Tool
from ninfer.server.endpoint import ParsedRequest
from ninfer.server.errors import APIError, invalid
from ninfer.server.generation import GenerationOptions
from ninfer.server.openai_chat.messages import parse_messages
from ninfer.server.request_context import RequestContext
from ninfer.server.validation.cache_markers import (
    CACHE_HINTS,
    check_advisory_cache_fields,
    implicit_candidate,
    limit_cache_writes,
)
from ninfer.server.validation.fields import (
    Field,
    Fields,
    cannot_provide,
    is_number,
    object_body,
    optional_bool,
    optional_int,
    optional_list,
    optional_object,
    optional_str,
    required_str,
    wrong_type,
)
from ninfer.server.validation.sampling import OPENAI_SAMPLING, openai_sampling, stop_field
from ninfer.server.validation.schema import (
    BOOLEAN,
    NO_ITEMS,
    NON_EMPTY_STRING,
    NULL,
    STRING,
    const,
    enum,
    obj,
    ref,
    unprovidable,
)
from ninfer.server.validation.thinking import (
    ThinkingChoice,
    check_preserve_thinking,
    check_template_kwargs,
    check_thinking_switch,
    effort_not_supported,
    exact_effort,
    template_option,
)
from ninfer.server.validation.structured_output import (
    DeclaredTool,
    ToolChoice,
    answer_format,
    json_format,
    tool_strict,
)
from ninfer.server.validation.tools import allowed_tools_mode, check_definition_flags, check_template_renders_tools

MAX_STOP_STRINGS = 4
# Accepted as constrained-decoding requests by other servers; rejected explicitly, never ignored.
CONSTRAINED_DECODING_ALIASES = (
    "grammar",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
# Template variables a client may set through chat_template_kwargs.
TEMPLATE_OPTIONS = ("enable_thinking", "preserve_thinking")

STREAM_OPTIONS = Fields({"include_usage": Field.boolean(), "include_obfuscation": Field.boolean()}, "stream_options")
JSON_SCHEMA_FORMAT = obj(
    {"name": NON_EMPTY_STRING, "description": STRING, "schema": ref("JsonSchema"), "strict": BOOLEAN},
    ("schema",),
    description="the schema is enforced whatever strict says",
)
FIELDS = Fields(
    {
        # Anything but a non-empty string (omitted, "", a number...) means the served model.
        "model": Field.shape({"anyOf": [ref("ModelId"), {"not": NON_EMPTY_STRING}]}),
        "messages": Field.shape({"type": "array", "minItems": 1, "items": ref("ChatMessage")}),
        "max_completion_tokens": Field.integer(0),
        "max_tokens": Field.integer(0, description="legacy spelling; equal to max_completion_tokens when both"),
        **OPENAI_SAMPLING,
        "stop": stop_field(MAX_STOP_STRINGS, allow_string=True),
        "stream": Field.boolean(),
        "stream_options": STREAM_OPTIONS.member(),
        "timings_per_token": Field.boolean(),
        "return_progress": Field.boolean(),
        "tools": Field.shape({"type": "array", "items": ref("ChatTool")}),
        "tool_choice": Field.shape(ref("ChatToolChoice")),
        "parallel_tool_calls": Field.boolean("false: at most one call (a grammar)"),
        "reasoning_effort": Field.choice(EFFORT_TIERS, "must be a tier the loaded template exposes (or none)"),
        "enable_thinking": Field.boolean(),
        "preserve_thinking": Field.boolean(),
        "chat_template_kwargs": Field.shape(obj(
            {option: BOOLEAN for option in TEMPLATE_OPTIONS},
            additionalProperties=unprovidable(NULL, "arbitrary chat template variables"),
        )),
        "n": Field.shape(unprovidable(const(1), "more than one choice")),
        "response_format": Field.shape({
            "anyOf": [
                obj({"type": enum(("text", "json_object"))}, ("type",)),
                obj({"type": const("json_schema"), "json_schema": JSON_SCHEMA_FORMAT}, ("type", "json_schema")),
            ],
            "description": "json_object: the answer is one JSON object; json_schema: one JSON value of the schema",
        }),
        "modalities": Field.shape(
            {"type": "array", "minItems": 1, "items": unprovidable(const("text"), "audio output")}
        ),
        "audio": Field.shape({
            "type": ["object", "null"],
            "description": "accepted without effect beside modalities [\"text\"]; with modalities omitted it asks "
                           "for audio output (400 unsupported_parameter)",
        }),
        "logit_bias": Field.shape({
            "type": "object",
            "additionalProperties": unprovidable({"type": "number", "enum": [0]}, "non-zero logit biases"),
        }),
        "logprobs": Field.boolean("true: choices carry the answer tokens' log probabilities"),
        "top_logprobs": Field.integer(0, 20, "alternatives per token; needs logprobs: true"),
        "web_search_options": Field.shape(unprovidable(NULL, "web search")),
        "moderation": Field.shape(unprovidable(NULL, "moderation")),
        "verbosity": Field.choice(("low", "medium", "high"), served=("medium",), refusal="low/high verbosity"),
        "store": Field.shape(unprovidable(const(False), "stored Chat Completions")),
        "functions": Field.shape(unprovidable(NO_ITEMS, "legacy function definitions (use tools)")),
        "function_call": Field.shape(enum(("none", "auto"), "legacy; forcing a function is unsupported")),
        **{alias: Field.shape(unprovidable(NULL, "other servers' constrained-decoding extensions (use "
                                                 "response_format)")) for alias in CONSTRAINED_DECODING_ALIASES},
        "repetition_penalty": Field.shape(
            unprovidable({"type": "number", "enum": [1]}, "repetition penalties other than 1")
        ),
        "mm_processor_kwargs": Field.shape({"type": "object", "additionalProperties": NULL}),
        "user": Field.string(),
        "safety_identifier": Field.string(),
        "service_tier": Field.string(),
        **CACHE_HINTS,
        "metadata": Field.shape({"type": "object", "additionalProperties": STRING}),
        "prediction": Field.shape(obj(
            {"type": const("content"), "content": {"anyOf": [STRING, {"type": "array"}]}}, ("type", "content")
        )),
    }
)


@dataclass
class ChatRequest(ParsedRequest):
    include_usage: bool = False  # stream_options.include_usage
    timings_per_token: bool = False
    return_progress: bool = False
    prompt_cache_implicit: bool = True  # prompt_cache_options.mode "explicit" turns the implicit candidate off

    @property
    def max_tokens(self) -> int | None:
        return self.options.max_tokens

    @property
    def sampling(self) -> SamplingOverrides:
        return self.options.sampling

    @property
    def stop(self) -> list[str]:
        return self.options.stop

    @property
    def callable_tools(self) -> dict[str, dict | None]:
        return self.options.tools or {}

    @property
    def tools_enabled(self) -> bool:
        return bool(self.options.tools)


def parse_chat_request(body: Any, context: RequestContext) -> ChatRequest:
    """Validate a parsed JSON body; raises APIError naming the offending field."""
    body = object_body(body)
    _check_model(body, context.model_id)
    _reject_unprovidable_options(body)
    _check_advisory_fields(body)
    messages, breakpoints = parse_messages(body, context.vision_enabled)
    tools, declared = _parse_tools(body)
    callable_tools, choice = _callable_tools(body, tools)
    parallel = FIELDS.read(body, "parallel_tool_calls") is not False
    answer = answer_format(
        json_format(optional_object(body, "response_format", "response_format"), "response_format", nested=True),
        declared, list(callable_tools), choice, parallel,
    )
    thinking = _thinking(body, context)
    implicit = implicit_candidate(body)
    limit_cache_writes(messages, breakpoints, implicit)
    conversation = Conversation(
        messages=messages,
        tools=tools,
        enable_thinking=thinking.enable_thinking,
        reasoning_effort=thinking.template_effort,
        preserve_thinking=thinking.preserve_thinking,
        implicit_cache_breakpoint=implicit,
    )
    check_template_renders_tools(conversation, context.capabilities, "tools" if tools else "messages")
    stream_options = FIELDS.read(body, "stream_options") or {}
    STREAM_OPTIONS.read(stream_options, "include_obfuscation")  # advisory
    options = GenerationOptions(
        max_tokens=_max_tokens(body),
        sampling=openai_sampling(body),
        stop=FIELDS.read(body, "stop"),
        tools=callable_tools or None,
        answer=answer,
        top_logprobs=_top_logprobs(body),
    )
    return ChatRequest(
        conversation=conversation,
        options=options,
        stream=bool(FIELDS.read(body, "stream")),
        include_usage=bool(STREAM_OPTIONS.read(stream_options, "include_usage")),
        timings_per_token=bool(FIELDS.read(body, "timings_per_token")),
        return_progress=bool(FIELDS.read(body, "return_progress")),
        requested_reasoning_effort=thinking.requested_effort,
        prompt_cache_implicit=implicit,
        routing_key=body.get("prompt_cache_key") or None,  # a string: _check_advisory_fields read it
    )


# ---- top-level options -----------------------------------------------------------------------


def _check_model(body: dict, model_id: str) -> None:
    # Only an explicit non-empty string names a model; anything else means "the loaded one".
    model = body.get("model")
    if isinstance(model, str) and model and model != model_id:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{model_id}'",
            code="model_not_found",
            param="model",
        )


def _reject_unprovidable_options(body: dict) -> None:
    """Options whose observable behaviour the engine cannot provide, rejected only when requested."""
    n = optional_int(body, "n", 1)
    if n is not None and n != 1:
        raise cannot_provide("n", "more than one choice per request")
    modalities = optional_list(body, "modalities", "modalities")
    if modalities is not None:
        for i, modality in enumerate(modalities):
            if modality == "audio":
                raise cannot_provide("modalities", "audio output")
            if modality != "text":
                raise invalid(f"modalities[{i}]", f"modalities[{i}] must be text, got {modality!r}")
        if not modalities:
            raise invalid("modalities", "modalities must contain text")
    # Audio is produced only for an "audio" modality; with modalities naming text alone, an audio
    # configuration (voice, format) is neutral. Omitted modalities leave it asking for audio.
    if optional_object(body, "audio", "audio") is not None and modalities is None:
        raise cannot_provide("audio", "audio output")
    _check_logit_bias(body)
    if body.get("web_search_options") is not None:
        raise cannot_provide("web_search_options", "web search")
    if body.get("moderation") is not None:
        raise cannot_provide("moderation", "input/output moderation")
    verbosity = FIELDS.read(body, "verbosity")
    if verbosity in ("low", "high"):
        raise cannot_provide("verbosity", f"{verbosity} output verbosity (only medium)")
    if optional_bool(body, "store", "store"):
        raise cannot_provide("store", "stored Chat Completions")
    _check_legacy_function_controls(body)
    for alias in CONSTRAINED_DECODING_ALIASES:
        if body.get(alias) is not None:
            raise cannot_provide(
                alias, f"the {alias} extension of constrained decoding (use response_format or tool_choice)"
            )
    repetition_penalty = body.get("repetition_penalty")
    if repetition_penalty is not None:
        if not is_number(repetition_penalty):
            raise wrong_type("repetition_penalty", "a number", repetition_penalty)
        if repetition_penalty != 1:
            raise cannot_provide("repetition_penalty", "a multiplicative repetition penalty other than 1")
    mm_kwargs = optional_object(body, "mm_processor_kwargs", "mm_processor_kwargs")
    for key, value in (mm_kwargs or {}).items():
        if value is not None:
            raise cannot_provide(f"mm_processor_kwargs.{key}", "per-request multimodal processor options")


def _check_logit_bias(body: dict) -> None:
    logit_bias = optional_object(body, "logit_bias", "logit_bias")
    for token, bias in (logit_bias or {}).items():
        path = f"logit_bias.{token}"
        if not is_number(bias):
            raise wrong_type(path, "a number", bias)
        if not math.isfinite(bias) or not -100 <= bias <= 100:
            raise invalid(path, f"{path} must be between -100 and 100, got {bias!r}")
        if bias != 0:
            raise cannot_provide("logit_bias", "token logit biasing (only all-zero biases)")


def _check_legacy_function_controls(body: dict) -> None:
    functions = optional_list(body, "functions", "functions")
    if functions:
        raise cannot_provide("functions", "legacy function calling (use tools)")
    function_call = body.get("function_call")
    if function_call is None or function_call in ("none", "auto"):
        return
    if isinstance(function_call, dict):
        raise cannot_provide("function_call", "a forced legacy function call")
    raise invalid("function_call", f"function_call must be none, auto or an object, got {function_call!r}")


def _check_advisory_fields(body: dict) -> None:
    """Advisory hints: accepted without changing execution, but their shape must be right."""
    for key in ("user", "safety_identifier", "service_tier"):
        FIELDS.read(body, key)
    check_advisory_cache_fields(body)
    metadata = optional_object(body, "metadata", "metadata")
    for key, value in (metadata or {}).items():
        if not isinstance(value, str):
            raise wrong_type(f"metadata.{key}", "a string", value)
    prediction = optional_object(body, "prediction", "prediction")
    if prediction is not None:
        if prediction.get("type") != "content":
            raise invalid("prediction.type", "prediction.type must be content")
        content = prediction.get("content")
        if not isinstance(content, (str, list)):
            raise wrong_type("prediction.content", "a string or an array of text parts", content)


def _top_logprobs(body: dict) -> int | None:
    """The alternatives per answer token when logprobs is true (top_logprobs 0..20), else None."""
    wanted = FIELDS.read(body, "logprobs")
    top = FIELDS.read(body, "top_logprobs")
    if top and not wanted:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    return (top or 0) if wanted else None


def _max_tokens(body: dict) -> int | None:
    modern = FIELDS.read(body, "max_completion_tokens")
    legacy = FIELDS.read(body, "max_tokens")
    if modern is not None and legacy is not None and modern != legacy:
        raise invalid("max_tokens", f"max_tokens ({legacy}) and max_completion_tokens ({modern}) disagree")
    return modern if modern is not None else legacy


# ---- tools -----------------------------------------------------------------------------------


def _parse_tools(body: dict) -> tuple[list[Tool], list[DeclaredTool]]:
    raw = optional_list(body, "tools", "tools") or []
    tools: list[Tool] = []
    declared: list[DeclaredTool] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        path = f"tools[{i}]"
        if not isinstance(item, dict):
            raise wrong_type(path, "an object", item)
        kind = required_str(item, "type", f"{path}.type")
        if kind != "function":
            raise cannot_provide(f"{path}.type", f"{kind} tools (only function tools)")
        function = item.get("function")
        if not isinstance(function, dict):
            raise wrong_type(f"{path}.function", "an object", function)
        name = required_str(function, "name", f"{path}.function.name", non_empty=True)
        if name in seen:
            raise invalid(f"{path}.function.name", f"{path}.function.name {name!r} is declared twice")
        seen.add(name)
        check_definition_flags(function, f"{path}.function")
        parameters = optional_object(function, "parameters", f"{path}.function.parameters")
        tools.append(
            Tool(
                name=name,
                description=optional_str(function, "description", f"{path}.function.description"),
                parameters=parameters,
            )
        )
        strict = tool_strict(function, f"{path}.function")
        declared.append(DeclaredTool(name, parameters, f"{path}.function.parameters", strict))
    return tools, declared


def _callable_tools(body: dict, tools: list[Tool]) -> tuple[dict[str, dict | None], ToolChoice]:
    """The effective callable set (every declared tool, narrowed by tool_choice; empty when
    disabled) and the choice: auto, none, required (allowed_tools may require) or one named tool."""
    declared = {tool.name: tool.parameters for tool in tools}
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return declared, ToolChoice("auto")
    if choice == "none":
        return {}, ToolChoice("none")  # tools stay in the prompt; calls stay text
    if choice == "required":
        return declared, ToolChoice("required")
    if isinstance(choice, dict):
        return _tool_choice_object(choice, declared)
    raise invalid("tool_choice", f"tool_choice must be auto, none, required or an object, got {choice!r}")


def _tool_choice_object(choice: dict, declared: dict[str, dict | None]) -> tuple[dict[str, dict | None], ToolChoice]:
    kind = required_str(choice, "type", "tool_choice.type")
    if kind == "custom":
        raise cannot_provide("tool_choice", "custom tools (only function tools)")
    if kind == "function":
        function = choice.get("function")
        if not isinstance(function, dict):
            raise wrong_type("tool_choice.function", "an object", function)
        name = required_str(function, "name", "tool_choice.function.name")
        if name not in declared:
            raise invalid("tool_choice.function.name", f"tool_choice.function.name {name!r} is not a declared tool")
        return {name: declared[name]}, ToolChoice("named", name)
    if kind != "allowed_tools":
        raise invalid("tool_choice.type", f"tool_choice.type must be function or allowed_tools, got {kind!r}")
    config = choice.get("allowed_tools")
    if not isinstance(config, dict):
        raise wrong_type("tool_choice.allowed_tools", "an object", config)
    mode = allowed_tools_mode(config, "tool_choice.allowed_tools.mode")
    entries = config.get("tools")
    if not isinstance(entries, list):
        raise wrong_type("tool_choice.allowed_tools.tools", "an array", entries)
    names: set[str] = set()
    for i, entry in enumerate(entries):
        path = f"tool_choice.allowed_tools.tools[{i}]"
        if not isinstance(entry, dict):
            raise wrong_type(path, "an object", entry)
        if entry.get("type") != "function" or not isinstance(entry.get("function"), dict):
            raise invalid(path, f"{path} must be {{'type': 'function', 'function': {{'name': ...}}}}")
        name = required_str(entry["function"], "name", f"{path}.function.name")
        if name not in declared:
            raise invalid(f"{path}.function.name", f"{path}.function.name {name!r} is not a declared tool")
        names.add(name)
    allowed = {name: schema for name, schema in declared.items() if name in names}  # declaration order
    return allowed, ToolChoice(mode)


# ---- thinking / template options -------------------------------------------------------------


def _thinking(body: dict, context: RequestContext) -> ThinkingChoice:
    """reasoning_effort, enable_thinking and preserve_thinking resolved against the loaded template."""
    caps = context.capabilities
    kwargs = optional_object(body, "chat_template_kwargs", "chat_template_kwargs") or {}
    check_template_kwargs(kwargs, TEMPLATE_OPTIONS)
    enable, enable_source = template_option(body, kwargs, "enable_thinking")
    preserve, preserve_source = template_option(body, kwargs, "preserve_thinking")
    effort = FIELDS.read(body, "reasoning_effort")
    choice = ThinkingChoice(requested_effort=effort)
    if effort is not None:
        if effort != "none" and effort not in caps.effort_tiers:
            raise effort_not_supported("reasoning_effort", effort, caps)
        if enable is not None and enable != (effort != "none"):
            raise APIError(
                400,
                f"reasoning_effort {effort!r} contradicts enable_thinking {str(enable).lower()}",
                code="conflicting_template_option",
                param=enable_source,
            )
        if enable is not None:
            check_thinking_switch(enable, enable_source, caps)  # the explicit switch names the field
        enable, choice.template_effort = exact_effort("reasoning_effort", effort, caps)
    elif enable is not None:
        check_thinking_switch(enable, enable_source, caps)
    choice.enable_thinking = enable
    choice.preserve_thinking = check_preserve_thinking(preserve, preserve_source, caps)
    return choice
