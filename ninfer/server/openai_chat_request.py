"""ChatRequest: an OpenAI Chat Completions body validated into a Conversation plus generation options.

Every field the spec names is either mapped, accepted as neutral/advisory, or rejected with a
field-specific APIError; options whose behaviour the engine cannot provide are rejected only
when they actually request that behaviour. Unknown top-level fields are ignored. Prompt-bearing
JSON objects (tool schemas, tool-call arguments) keep their received member order.

The file is long because the spec gives some sixty fields a rule each; keeping one protocol's
request rules together makes it auditable against the spec paragraph by paragraph.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ninfer.contract.sampling import TOP_K_CAP, SamplingOverrides
from ninfer.frontend.capabilities import EFFORT_TIERS, TemplateCapabilities
from ninfer.frontend.conversation import Conversation, MediaPart, Message, Part, TextPart, Tool, ToolCall
from ninfer.server.errors import APIError, invalid
from ninfer.server.json_fields import (
    cannot_provide,
    is_number,
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

MAX_STOP_STRINGS = 4
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

# Accepted as constrained-decoding requests by other servers; rejected explicitly, never ignored.
CONSTRAINED_DECODING_ALIASES = (
    "grammar",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
# Template variables the spec lets a client set through chat_template_kwargs.
TEMPLATE_OPTIONS = ("enable_thinking", "preserve_thinking")
CACHE_TTLS = ("30m", "12h")
PROMPT_CACHE_RETENTIONS = ("in_memory", "24h")
MEDIA_SCHEMES = ("http://", "https://", "data:")
MEDIA_PART_KINDS = {"image_url": "image", "video_url": "video"}
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
ASSISTANT_ONLY_FIELDS = ("reasoning_content", "reasoning", "tool_calls", "function_call", "refusal", "audio")


@dataclass(frozen=True)
class ChatContext:
    """Server facts the request rules depend on."""

    model_id: str  # public model id
    capabilities: TemplateCapabilities
    vision_enabled: bool = False  # media parts -> 400 vision_disabled when False


@dataclass
class ChatRequest:
    conversation: Conversation
    stream: bool
    include_usage: bool  # stream_options.include_usage
    max_tokens: int | None  # None: server default; 0: prompt processing only
    sampling: SamplingOverrides
    stop: list[str]
    tools_enabled: bool  # False: tool_choice "none" or nothing callable; calls stay text
    callable_tools: dict[str, dict | None]  # name -> parameters schema, declaration order
    timings_per_token: bool
    return_progress: bool
    requested_reasoning_effort: str | None  # the client value, for logs
    prompt_cache_implicit: bool = True  # prompt_cache_options.mode "explicit" turns the implicit candidate off


def parse_chat_request(body: Any, context: ChatContext) -> ChatRequest:
    """Validate a parsed JSON body; raises APIError naming the offending field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not {json_type(body)}", code="invalid_type")
    _check_model(body, context.model_id)
    _reject_unprovidable_options(body)
    _check_advisory_fields(body)
    messages = _parse_messages(body, context.vision_enabled)
    tools = _parse_tools(body)
    callable_tools = _callable_tools(body, tools)
    thinking = _ThinkingOptions.parse(body, context.capabilities)
    conversation = Conversation(
        messages=messages,
        tools=tools,
        enable_thinking=thinking.enable_thinking,
        reasoning_effort=thinking.template_effort,
        preserve_thinking=thinking.preserve_thinking,
    )
    stream_options = optional_object(body, "stream_options", "stream_options") or {}
    optional_bool(stream_options, "include_obfuscation", "stream_options.include_obfuscation")  # advisory
    return ChatRequest(
        conversation=conversation,
        stream=bool(optional_bool(body, "stream", "stream")),
        include_usage=bool(optional_bool(stream_options, "include_usage", "stream_options.include_usage")),
        max_tokens=_max_tokens(body),
        sampling=_sampling(body),
        stop=_stop(body),
        tools_enabled=bool(callable_tools),
        callable_tools=callable_tools,
        timings_per_token=bool(optional_bool(body, "timings_per_token", "timings_per_token")),
        return_progress=bool(optional_bool(body, "return_progress", "return_progress")),
        requested_reasoning_effort=thinking.requested_effort,
        prompt_cache_implicit=_prompt_cache_implicit(body),
    )


# ---- JSON shape helpers ----------------------------------------------------------------------


def _enum(obj: dict, key: str, path: str, allowed: tuple[str, ...]) -> str | None:
    value = optional_str(obj, key, path)
    if value is not None and value not in allowed:
        raise invalid(path, f"{path} must be one of {', '.join(allowed)}, got {value!r}")
    return value


# ---- top-level options -----------------------------------------------------------------------


def _check_model(body: dict, model_id: str) -> None:
    # Windows-fork rule: only an explicit non-empty string names a model; anything else means "the loaded one".
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
    response_format = optional_object(body, "response_format", "response_format")
    if response_format is not None:
        kind = required_str(response_format, "type", "response_format.type")
        if kind in ("json_object", "json_schema"):
            raise cannot_provide("response_format", f"JSON constrained output ({kind})")
        if kind != "text":
            raise invalid("response_format.type", f"response_format.type must be text, got {kind!r}")
    modalities = optional_list(body, "modalities", "modalities")
    if modalities is not None:
        for i, modality in enumerate(modalities):
            if modality == "audio":
                raise cannot_provide("modalities", "audio output")
            if modality != "text":
                raise invalid(f"modalities[{i}]", f"modalities[{i}] must be text, got {modality!r}")
        if not modalities:
            raise invalid("modalities", "modalities must contain text")
    if body.get("audio") is not None:
        raise cannot_provide("audio", "audio output")
    _check_logit_bias(body)
    if optional_bool(body, "logprobs", "logprobs"):
        raise cannot_provide("logprobs", "token log probabilities")
    top_logprobs = optional_int(body, "top_logprobs", 0, 20)
    if top_logprobs:
        raise cannot_provide("top_logprobs", "token log probabilities")
    if body.get("web_search_options") is not None:
        raise cannot_provide("web_search_options", "web search")
    if body.get("moderation") is not None:
        raise cannot_provide("moderation", "input/output moderation")
    verbosity = _enum(body, "verbosity", "verbosity", ("low", "medium", "high"))
    if verbosity in ("low", "high"):
        raise cannot_provide("verbosity", f"{verbosity} output verbosity (only medium)")
    if optional_bool(body, "store", "store"):
        raise cannot_provide("store", "stored Chat Completions")
    _check_legacy_function_controls(body)
    for alias in CONSTRAINED_DECODING_ALIASES:
        if body.get(alias) is not None:
            raise cannot_provide(alias, "constrained decoding")
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
    for key in ("user", "safety_identifier", "service_tier", "prompt_cache_key"):
        optional_str(body, key, key)
    metadata = optional_object(body, "metadata", "metadata")
    for key, value in (metadata or {}).items():
        if not isinstance(value, str):
            raise wrong_type(f"metadata.{key}", "a string", value)
    _enum(body, "prompt_cache_retention", "prompt_cache_retention", PROMPT_CACHE_RETENTIONS)
    prediction = optional_object(body, "prediction", "prediction")
    if prediction is not None:
        if prediction.get("type") != "content":
            raise invalid("prediction.type", "prediction.type must be content")
        content = prediction.get("content")
        if not isinstance(content, (str, list)):
            raise wrong_type("prediction.content", "a string or an array of text parts", content)


def _prompt_cache_implicit(body: dict) -> bool:
    options = optional_object(body, "prompt_cache_options", "prompt_cache_options")
    if options is None:
        return True
    _enum(options, "ttl", "prompt_cache_options.ttl", CACHE_TTLS)
    return _enum(options, "mode", "prompt_cache_options.mode", ("implicit", "explicit")) != "explicit"


def _max_tokens(body: dict) -> int | None:
    modern = optional_int(body, "max_completion_tokens", 0)
    legacy = optional_int(body, "max_tokens", 0)
    if modern is not None and legacy is not None and modern != legacy:
        raise invalid("max_tokens", f"max_tokens ({legacy}) and max_completion_tokens ({modern}) disagree")
    return modern if modern is not None else legacy


def _sampling(body: dict) -> SamplingOverrides:
    return SamplingOverrides(
        temperature=optional_number(body, "temperature", 0, 2),
        top_p=optional_number(body, "top_p", 0, 1),
        top_k=optional_int(body, "top_k", 0, TOP_K_CAP),
        min_p=optional_number(body, "min_p", 0, 1),
        presence_penalty=optional_number(body, "presence_penalty", -2, 2),
        frequency_penalty=optional_number(body, "frequency_penalty", -2, 2),
        seed=optional_int(body, "seed", SEED_MIN, SEED_MAX),
    )


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
        paths = ["stop"]
    elif isinstance(stop, list):
        if len(stop) > MAX_STOP_STRINGS:
            raise invalid("stop", f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        paths = [f"stop[{i}]" for i in range(len(stop))]
    else:
        raise wrong_type("stop", "a string or an array of strings", stop)
    for path, value in zip(paths, stop):
        if not isinstance(value, str):
            raise wrong_type(path, "a string", value)
        if not value:
            raise invalid(path, f"{path} must be a non-empty string")
    return list(stop)


# ---- messages --------------------------------------------------------------------------------


def _parse_messages(body: dict, vision_enabled: bool) -> list[Message]:
    raw = body.get("messages")
    if raw is None:
        raise invalid("messages", "messages is required", code="missing_required_parameter")
    if not isinstance(raw, list):
        raise wrong_type("messages", "an array of messages", raw)
    if not raw:
        raise invalid("messages", "messages must contain at least one message")
    parser = _MessageParser(vision_enabled)
    return [parser.parse(item, f"messages[{i}]") for i, item in enumerate(raw)]


class _MessageParser:
    """Parses messages in order; remembers legacy function calls so results can be paired."""

    def __init__(self, vision_enabled: bool):
        self.vision_enabled = vision_enabled
        self.messages: list[Message] = []
        self.legacy_calls: dict[int, ToolCall] = {}  # message index -> its legacy function_call

    def parse(self, raw: Any, path: str) -> Message:
        if not isinstance(raw, dict):
            raise wrong_type(path, "an object", raw)
        role = required_str(raw, "role", f"{path}.role")
        if role not in ROLES:
            raise invalid(f"{path}.role", f"{path}.role must be one of {', '.join(ROLES)}, got {role!r}")
        if role != "assistant":
            self._reject_assistant_fields(raw, path)
        if role == "function":
            message = self._function_result(raw, path)
        else:
            self._check_name(raw, role, path)
            if role == "assistant":
                message = self._assistant(raw, path)
            else:
                message = Message(role=role, content=self._content(raw, role, path))
                if role == "tool":
                    message.tool_call_id = required_str(raw, "tool_call_id", f"{path}.tool_call_id", non_empty=True)
        self.messages.append(message)
        return message

    @staticmethod
    def _reject_assistant_fields(raw: dict, path: str) -> None:
        # Dropping them would silently lose prompt content, so they are errors rather than unknown fields.
        for key in ASSISTANT_ONLY_FIELDS:
            if raw.get(key) not in (None, []):
                raise invalid(f"{path}.{key}", f"{path}.{key}: only assistant messages carry {key}")

    @staticmethod
    def _check_name(raw: dict, role: str, path: str) -> None:
        name = raw.get("name")
        if name is None:
            return
        if not isinstance(name, str):
            raise wrong_type(f"{path}.name", "a string", name)
        # Tool results may mirror the function name (ignored); other roles would need participant identity.
        if name and role != "tool":
            raise cannot_provide(f"{path}.name", "participant names (the chat template cannot represent them)")

    def _assistant(self, raw: dict, path: str) -> Message:
        if raw.get("audio") is not None:
            raise cannot_provide(f"{path}.audio", "audio output history")
        content = self._content(raw, "assistant", path, nullable=True)
        refusal = optional_str(raw, "refusal", f"{path}.refusal")
        if refusal:
            content.append(TextPart(refusal))  # a replayed refusal is what the assistant said
        message = Message(role="assistant", content=content, reasoning=self._reasoning(raw, path))
        tool_calls = optional_list(raw, "tool_calls", f"{path}.tool_calls") or []
        message.tool_calls = [self._tool_call(call, f"{path}.tool_calls[{i}]") for i, call in enumerate(tool_calls)]
        function_call = optional_object(raw, "function_call", f"{path}.function_call")
        if function_call is not None:
            if message.tool_calls:
                raise invalid(f"{path}.function_call", f"{path}: give either tool_calls or function_call, not both")
            # Legacy calls carry no id; derive one from the position so replays render identically.
            call = ToolCall(
                name=required_str(function_call, "name", f"{path}.function_call.name", non_empty=True),
                arguments=_arguments(function_call, f"{path}.function_call.arguments"),
                call_id=f"call_legacy_{len(self.messages)}",
            )
            message.tool_calls = [call]
            self.legacy_calls[len(self.messages)] = call
        return message

    @staticmethod
    def _reasoning(raw: dict, path: str) -> str | None:
        content = optional_str(raw, "reasoning_content", f"{path}.reasoning_content")
        alias = optional_str(raw, "reasoning", f"{path}.reasoning")
        if content is not None and alias is not None and content != alias:
            raise invalid(f"{path}.reasoning", f"{path}: reasoning and reasoning_content are aliases but differ")
        return content if content is not None else alias

    @staticmethod
    def _tool_call(raw: Any, path: str) -> ToolCall:
        if not isinstance(raw, dict):
            raise wrong_type(path, "an object", raw)
        kind = optional_str(raw, "type", f"{path}.type")
        if kind not in (None, "function"):
            if kind == "custom":
                raise cannot_provide(f"{path}.type", "custom tool calls")
            raise invalid(f"{path}.type", f"{path}.type must be function, got {kind!r}")
        call_id = optional_str(raw, "id", f"{path}.id")
        function = raw.get("function")
        if not isinstance(function, dict):
            raise wrong_type(f"{path}.function", "an object", function)
        name = required_str(function, "name", f"{path}.function.name", non_empty=True)
        return ToolCall(name=name, arguments=_arguments(function, f"{path}.function.arguments"), call_id=call_id)

    def _function_result(self, raw: dict, path: str) -> Message:
        """Legacy role "function": a result for the preceding assistant function_call."""
        name = required_str(raw, "name", f"{path}.name", non_empty=True)
        content = raw.get("content")
        if content is not None and not isinstance(content, str):
            raise wrong_type(f"{path}.content", "a string or null", content)
        call = self._preceding_legacy_call()
        if call is None:
            raise invalid(path, f"{path}: a function result must follow an assistant message with a function_call")
        if call.name != name:
            raise invalid(
                f"{path}.name", f"{path}.name {name!r} does not match the preceding function_call {call.name!r}"
            )
        return Message(role="tool", content=[TextPart(content)] if content else [], tool_call_id=call.call_id)

    def _preceding_legacy_call(self) -> ToolCall | None:
        for index in range(len(self.messages) - 1, -1, -1):
            if self.messages[index].role != "tool":
                return self.legacy_calls.get(index)  # the nearest non-result message must hold the call
        return None

    def _content(self, raw: dict, role: str, path: str, *, nullable: bool = False) -> list[Part]:
        content = raw.get("content")
        path = f"{path}.content"
        if content is None:
            if nullable:
                return []  # an assistant turn of only tool calls or reasoning
            raise invalid(path, f"{path} is required", code="missing_required_parameter")
        if isinstance(content, str):
            return [TextPart(content)]
        if not isinstance(content, list):
            raise wrong_type(path, "a string or an array of content parts", content)
        # Adjacent text parts stay separate: the builder joins them without inserting separators.
        return [self._part(part, role, f"{path}[{i}]") for i, part in enumerate(content)]

    def _part(self, raw: Any, role: str, path: str) -> Part:
        if not isinstance(raw, dict):
            raise wrong_type(path, "an object", raw)
        kind = required_str(raw, "type", f"{path}.type")
        breakpoint_ = _cache_breakpoint(raw, path)
        if kind == "text":
            return TextPart(required_str(raw, "text", f"{path}.text"), cache_breakpoint=breakpoint_)
        if kind == "refusal":
            if role != "assistant":
                raise invalid(f"{path}.type", f"{path}: refusal parts belong to assistant messages")
            return TextPart(required_str(raw, "refusal", f"{path}.refusal"), cache_breakpoint=breakpoint_)
        if kind in MEDIA_PART_KINDS:
            if role not in ("user", "tool"):
                raise invalid(f"{path}.type", f"{path}: {kind} parts belong to user or tool messages")
            return self._media(raw, kind, path, breakpoint_)
        if kind == "input_audio":
            raise cannot_provide(path, "audio input")
        if kind == "file":
            raise cannot_provide(path, "file input")
        raise invalid(f"{path}.type", f"{path}.type {kind!r} is not a known content part type")

    def _media(self, raw: dict, kind: str, path: str, breakpoint_: bool) -> MediaPart:
        if not self.vision_enabled:
            raise APIError(
                400,
                f"{path}: media input needs a server started with --vision",
                code="vision_disabled",
                param=path,
            )
        source = raw.get(kind)
        source_path = f"{path}.{kind}"
        if isinstance(source, str):
            url = source  # string-form URL: a widely generated compatible shape
        elif isinstance(source, dict):
            url = required_str(source, "url", f"{source_path}.url")
            source_path = f"{source_path}.url"
            detail = _enum(source, "detail", f"{path}.{kind}.detail", ("auto", "low", "high", "original"))
            if detail not in (None, "auto"):
                raise cannot_provide(f"{path}.{kind}.detail", f"explicit {detail} image detail (only auto)")
        else:
            raise wrong_type(source_path, "a URL string or an object with url", source)
        if not url.lower().startswith(MEDIA_SCHEMES):
            raise invalid(source_path, f"{source_path} must be an http(s) URL or a data: URI", code="invalid_media")
        return MediaPart(kind=MEDIA_PART_KINDS[kind], url=url, cache_breakpoint=breakpoint_)


def _cache_breakpoint(raw: dict, path: str) -> bool:
    marker = optional_object(raw, "prompt_cache_breakpoint", f"{path}.prompt_cache_breakpoint")
    if marker is None:
        return False
    if marker.get("mode") != "explicit":
        raise invalid(f"{path}.prompt_cache_breakpoint.mode", "prompt_cache_breakpoint.mode must be explicit")
    _enum(marker, "ttl", f"{path}.prompt_cache_breakpoint.ttl", CACHE_TTLS)
    return True


def _reject_non_finite(constant: str) -> Any:
    raise ValueError(f"{constant} is not valid JSON")


def _arguments(function: dict, path: str) -> dict[str, Any]:
    """A JSON string holding an object; its member order is kept (json.loads preserves it)."""
    text = function.get("arguments")
    if text is None:
        raise invalid(path, f"{path} is required", code="missing_required_parameter")
    if not isinstance(text, str):
        raise wrong_type(path, "a JSON string", text)
    try:
        arguments = json.loads(text, parse_constant=_reject_non_finite)
    except ValueError as error:
        raise invalid(path, f"{path} is not valid JSON: {error}") from None
    if not isinstance(arguments, dict):
        raise invalid(path, f"{path} must encode a JSON object, not {json_type(arguments)}")
    return arguments


# ---- tools -----------------------------------------------------------------------------------


def _parse_tools(body: dict) -> list[Tool]:
    raw = optional_list(body, "tools", "tools") or []
    tools: list[Tool] = []
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
        if optional_bool(function, "strict", f"{path}.function.strict"):
            raise cannot_provide(f"{path}.function.strict", "strict schema adherence (constrained decoding)")
        tools.append(
            Tool(
                name=name,
                description=optional_str(function, "description", f"{path}.function.description"),
                parameters=optional_object(function, "parameters", f"{path}.function.parameters"),
            )
        )
    return tools


def _callable_tools(body: dict, tools: list[Tool]) -> dict[str, dict | None]:
    """The effective callable set: every declared tool, narrowed by tool_choice; empty when disabled."""
    declared = {tool.name: tool.parameters for tool in tools}
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        allowed = declared
    elif choice == "none":
        allowed = {}  # tools stay in the prompt; calls stay text
    elif choice == "required":
        raise cannot_provide("tool_choice", "required tool calls")
    elif isinstance(choice, dict):
        allowed = _allowed_tools(choice, declared)
    else:
        raise invalid("tool_choice", f"tool_choice must be auto, none or an allowed_tools object, got {choice!r}")
    parallel = optional_bool(body, "parallel_tool_calls", "parallel_tool_calls")
    if parallel is False and allowed:
        raise cannot_provide("parallel_tool_calls", "limiting a turn to one tool call")
    return allowed


def _allowed_tools(choice: dict, declared: dict[str, dict | None]) -> dict[str, dict | None]:
    kind = required_str(choice, "type", "tool_choice.type")
    if kind in ("function", "custom"):
        raise cannot_provide("tool_choice", "a named (forced) tool choice")
    if kind != "allowed_tools":
        raise invalid("tool_choice.type", f"tool_choice.type must be allowed_tools, got {kind!r}")
    config = choice.get("allowed_tools")
    if not isinstance(config, dict):
        raise wrong_type("tool_choice.allowed_tools", "an object", config)
    mode = required_str(config, "mode", "tool_choice.allowed_tools.mode")
    if mode == "required":
        raise cannot_provide("tool_choice.allowed_tools.mode", "required tool calls")
    if mode != "auto":
        raise invalid("tool_choice.allowed_tools.mode", f"tool_choice.allowed_tools.mode must be auto, got {mode!r}")
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
    return {name: schema for name, schema in declared.items() if name in names}  # declaration order


# ---- thinking / template options -------------------------------------------------------------


@dataclass
class _ThinkingOptions:
    """reasoning_effort, enable_thinking and preserve_thinking resolved against the loaded template."""

    enable_thinking: bool | None = None
    template_effort: str | None = None  # the tier passed to the template
    preserve_thinking: bool | None = None
    requested_effort: str | None = None
    sources: dict[str, str] = field(default_factory=dict)  # option -> the spelling that supplied it

    @classmethod
    def parse(cls, body: dict, caps: TemplateCapabilities) -> _ThinkingOptions:
        options = cls()
        kwargs = optional_object(body, "chat_template_kwargs", "chat_template_kwargs") or {}
        for key, value in kwargs.items():
            if key not in TEMPLATE_OPTIONS and value is not None:
                raise cannot_provide(f"chat_template_kwargs.{key}", "arbitrary chat template variables")
        enable = options._template_option(body, kwargs, "enable_thinking")
        options.preserve_thinking = options._template_option(body, kwargs, "preserve_thinking")
        effort = _enum(body, "reasoning_effort", "reasoning_effort", EFFORT_TIERS)
        options.requested_effort = effort
        if effort is not None and effort != "none" and effort not in caps.effort_tiers:
            exposed = ", ".join(("none", *(t for t in caps.effort_tiers if t != "none")))
            raise APIError(
                400,
                f"reasoning_effort {effort!r} is not exposed by the loaded chat template (supported: {exposed})",
                code="reasoning_effort_not_supported",
                param="reasoning_effort",
            )
        if effort is not None and enable is not None and enable != (effort != "none"):
            raise APIError(
                400,
                f"reasoning_effort {effort!r} contradicts enable_thinking {str(enable).lower()}",
                code="conflicting_template_option",
                param=options.sources["enable_thinking"],
            )
        if effort is not None:
            enable = effort != "none"
            # "none" reaches the template only when it is one of the template's own tiers.
            options.template_effort = effort if effort != "none" or "none" in caps.effort_tiers else None
        if enable is not None and not _thinking_reachable(caps, enable):
            state = "enabling" if enable else "disabling"
            if "enable_thinking" not in options.sources:  # only reasoning_effort "none" asked for it
                raise APIError(
                    400,
                    f"reasoning_effort {effort!r}: {state} thinking is not exposed by the loaded chat template",
                    code="reasoning_effort_not_supported",
                    param="reasoning_effort",
                )
            raise cannot_provide(
                options.sources["enable_thinking"],
                f"{state} thinking (the loaded chat template has no thinking switch)",
            )
        options.enable_thinking = enable
        if options.preserve_thinking and not caps.supports_preserve_thinking:
            raise cannot_provide(
                options.sources["preserve_thinking"],
                "preserving closed-turn reasoning (the loaded chat template has no preserve_thinking switch)",
            )
        return options

    def _template_option(self, body: dict, kwargs: dict, name: str) -> bool | None:
        """A boolean given at top level or in chat_template_kwargs; both spellings must agree."""
        top = optional_bool(body, name, name)
        nested = optional_bool(kwargs, name, f"chat_template_kwargs.{name}")
        if top is not None and nested is not None and top != nested:
            raise APIError(
                400,
                f"{name} ({str(top).lower()}) and chat_template_kwargs.{name} ({str(nested).lower()}) disagree",
                code="conflicting_template_option",
                param=name,
            )
        if top is not None:
            self.sources[name] = name
        elif nested is not None:
            self.sources[name] = f"chat_template_kwargs.{name}"
        return top if top is not None else nested


def _thinking_reachable(caps: TemplateCapabilities, enable: bool) -> bool:
    """Whether the template can render a new turn with thinking on (or off) at all."""
    if caps.supports_thinking_switch or caps.thinking_default == enable:
        return True
    if enable:
        return any(tier != "none" for tier in caps.effort_tiers)
    return "none" in caps.effort_tiers
