"""What the OpenAPI request schemas cannot express, and the document narrowed so that it can.

The OpenAPI document (ninfer/server/openapi.py, each request schema from its protocol's
request definition) describes each request body with JSON Schema, which cannot state rules
that relate two fields, read JSON inside a string, know the server's state or the loaded chat
template. Each such rule is one entry of INEXPRESSIBLE (the validator's rule, then how the
generation document avoids it); `accepted_document` applies them, so every body generated from
it must be accepted outright. The property test (tests/server/test_openapi.py) and the fuzz
campaign's positive cases (benchmarks/reliability/fuzz.py) both generate from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ninfer.frontend.capabilities import EFFORT_TIERS, TemplateCapabilities
from ninfer.server.openapi import openapi_document
from ninfer.server.validation.schema import NULL, const, integer, nullable, ref
from ninfer.server.validation.thinking import thinking_reachable

Schemas = dict[str, Any]
# Generated tool-call arguments: valid JSON-object text (member order kept, as the prompt needs).
JSON_OBJECT_TEXTS = ["{}", '{"path": "a.txt", "limit": 3}']


@dataclass(frozen=True)
class Narrowing:
    rule: str  # the validator's rule the schema cannot state
    apply: Callable[[Schemas], None]


def _set(schemas: Schemas, path: str, value: Any) -> None:
    """Replace the node at a dotted path under components.schemas (digits index lists)."""
    *parents, last = path.split(".")
    node: Any = schemas
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[int(last) if last.isdigit() else last] = value


def _edits(*pairs: tuple[str, Any]) -> Callable[[Schemas], None]:
    def apply(schemas: Schemas) -> None:
        for path, value in pairs:
            _set(schemas, path, value)

    return apply


NO_ITEMS = {"type": "array", "maxItems": 0}
ONE_ITEM_TOOLS = {"type": "array", "maxItems": 1}
ITEM_SCHEMAS = ("InstructionMessageItem", "AssistantMessageItem")
MESSAGES_REQUESTS = ("MessagesRequest", "MessagesCountTokensRequest")
RESPONSES_REQUESTS = ("ResponseCreateRequest", "ResponseInputTokensRequest")


def _items_limited(limit: int, items: Any) -> dict:
    return {"type": "array", "maxItems": limit, "items": items}


INEXPRESSIBLE: list[Narrowing] = [
    Narrowing(
        "tool-call arguments are JSON-object text",
        _edits(("JsonObjectText", {"type": "string", "enum": JSON_OBJECT_TEXTS})),
    ),
    Narrowing(
        "Chat: max_tokens and max_completion_tokens are equal when both are given",
        _edits(("ChatCompletionRequest.properties.max_completion_tokens", NULL)),
    ),
    Narrowing(
        "Chat: an audio object is neutral only beside modalities naming text (omitted, it asks for audio)",
        _edits(("ChatCompletionRequest.properties.audio", NULL)),
    ),
    Narrowing(
        "enable_thinking/preserve_thinking and their chat_template_kwargs spellings agree, and (Chat) "
        "enable_thinking does not contradict reasoning_effort",
        _edits(
            ("ChatCompletionRequest.properties.enable_thinking", NULL),
            ("ChatCompletionRequest.properties.preserve_thinking", NULL),
            ("ChatCompletionRequest.properties.chat_template_kwargs.anyOf.0.properties.enable_thinking", NULL),
            ("ResponsesTemplateKwargs.properties.preserve_thinking", NULL),
        ),
    ),
    Narrowing(
        "Chat: an assistant's reasoning equals its reasoning_content; tool_calls and function_call exclude "
        "each other; a legacy function result follows the function_call it answers",
        _edits(
            ("ChatAssistantMessage.properties.reasoning", NULL),
            ("ChatAssistantMessage.properties.function_call", NULL),
            ("ChatMessage.anyOf", [ref("ChatInstructionMessage"), ref("ChatAssistantMessage"),
                                   ref("ChatToolMessage")]),
        ),
    ),
    Narrowing(
        "tool names (Responses: namespace and name) are unique within a request; allowed_tools names declared "
        "tools; parallel_tool_calls false is refused while tools are callable",
        _edits(
            ("ChatCompletionRequest.properties.tools", _items_limited(1, ref("ChatTool"))),
            ("ChatToolChoice.anyOf.2.properties.allowed_tools.properties.tools", NO_ITEMS),
            ("ChatCompletionRequest.properties.parallel_tool_calls", {"enum": [True, None]}),
            *((f"{name}.properties.tools", _items_limited(1, ref("ResponsesTool"))) for name in RESPONSES_REQUESTS),
            ("ResponsesTool.anyOf.1.properties.tools.maxItems", 1),
            ("ResponsesToolChoice.anyOf.2.properties.tools", NO_ITEMS),
            *((f"{name}.properties.parallel_tool_calls", {"enum": [True, None]}) for name in RESPONSES_REQUESTS),
            *((f"{name}.properties.tools", _items_limited(1, ref("MessagesTool"))) for name in MESSAGES_REQUESTS),
            ("MessagesToolChoice.anyOf.0.properties.disable_parallel_tool_use", {"enum": [False, None]}),
        ),
    ),
    Narrowing(
        "a JSON schema in an output format or in the parameters of a tool a grammar may call compiles into a grammar "
        "(checked at preparation); a "
        "required or named tool choice names callable, declared tools; top_logprobs needs logprobs; an output "
        "format or a forced tool excludes a Messages assistant prefill",
        _edits(
            ("JsonSchema", {"enum": [{"type": "object"}, {"type": "object", "properties": {"q": {"type": "string"}},
                                                          "required": ["q"]}]}),
            ("FunctionFlags.properties.strict", const(False)),
            ("ChatToolChoice.anyOf.0", {"enum": ["auto", "none", None]}),
            ("ChatToolChoice.anyOf.1", {"enum": ["auto"]}),
            ("ChatToolChoice.anyOf.2.properties.allowed_tools.properties.mode", const("auto")),
            ("ChatCompletionRequest.properties.top_logprobs", {"enum": [0, None]}),
            ("ResponsesToolChoice.anyOf.0", {"enum": ["auto", "none", None]}),
            ("ResponsesToolChoice.anyOf.1", {"enum": ["auto"]}),
            ("ResponsesToolChoice.anyOf.2.properties.mode", const("auto")),
            ("MessagesToolChoice.anyOf.0.properties.type", const("auto")),
            ("MessagesToolChoice.anyOf.1", {"not": {}}),
            *((f"{name}.properties.output_format", NULL) for name in MESSAGES_REQUESTS),
            *((f"{name}.properties.output_config.anyOf.0.properties.format", NULL) for name in MESSAGES_REQUESTS),
        ),
    ),
    Narrowing(
        "Responses: Item ids are unique; previous_response_id names a stored Response; a reasoning Item's "
        "encrypted_content is NInfer's envelope; one assistant turn is reasoning, then message, then calls, "
        "and results answer the preceding calls in order",
        _edits(
            *((f"{name}.properties.id", NULL) for name in ITEM_SCHEMAS),
            *((f"{name}.properties.previous_response_id", NULL) for name in RESPONSES_REQUESTS),
            ("InputItem.anyOf", [ref("InstructionMessageItem"), ref("AssistantMessageItem")]),
        ),
    ),
    Narrowing(
        "Messages: tool_use and tool_result blocks pair across turns (unique ids, results leading the next "
        "user turn); a final assistant turn (a prefill) holds no thinking, and thinking is not enabled with "
        "one; budget_tokens < max_tokens; at most four blocks carry cache_control, and the request-level "
        "marker agrees with the block it lands on; input_examples and input_schema.examples exclude each other",
        _edits(
            ("UserMessage.properties.content.anyOf.1.items", ref("TextBlock")),
            ("AssistantMessage.properties.content.anyOf.1.items", ref("TextBlock")),
            ("TextBlock.properties.cache_control", NULL),
            ("MessagesTool.allOf.1.properties.cache_control", NULL),
            ("MessagesTool.allOf.1.properties.input_examples", NULL),
            *((f"{name}.properties.thinking", {"anyOf": [ref("MessagesThinking"), NULL]}) for name in MESSAGES_REQUESTS),
            ("MessagesThinking.anyOf", [{"type": "object", "required": ["type"], "properties": {"type": const("disabled")}}]),
        ),
    ),
    Narrowing(
        "Messages: a final assistant turn with no text is dropped, and something must remain to render",
        _edits(*((f"{name}.properties.messages.contains", ref("UserMessage")) for name in MESSAGES_REQUESTS)),
    ),
]
# The one refusal a body of the narrowed document may still get from a server: its prompt, in tokens,
# past --max-context (string lengths in the schema cannot bound tokens).
PROMPT_LIMIT_CODES = frozenset({"context_length_exceeded"})
# With --vision, a generated media source is an arbitrary URL or data: URI: the server may fail to
# fetch it, refuse its address or find its bytes no image; those refusals answer a valid body.
MEDIA_SOURCE_CODES = frozenset({"invalid_media", "media_fetch_failed", "media_fetch_timeout"})


def _capability_narrowings(caps: TemplateCapabilities) -> list[Narrowing]:
    """The loaded chat template decides which thinking and tool options can be rendered."""
    efforts = [effort for effort in EFFORT_TIERS if effort in caps.effort_tiers or effort == "none"]
    if not thinking_reachable(caps, False):
        efforts.remove("none")
    efforts_or_null = {"enum": [*efforts, None]}
    preserve_or_null = {"enum": [True, False, None] if caps.supports_preserve_thinking else [False, None]}
    thinking = [
        ("ChatCompletionRequest.properties.reasoning_effort", efforts_or_null),
        ("ResponsesReasoning.properties.effort", efforts_or_null),
        ("ChatCompletionRequest.properties.chat_template_kwargs.anyOf.0.properties.preserve_thinking",
         preserve_or_null),
        *((f"{name}.properties.preserve_thinking", preserve_or_null) for name in (*RESPONSES_REQUESTS,
                                                                                   *MESSAGES_REQUESTS)),
    ]
    if not thinking_reachable(caps, False):
        thinking += [(f"{name}.properties.thinking", NULL) for name in MESSAGES_REQUESTS]  # only disabled is left
    narrowings = [Narrowing("reasoning effort, the thinking switch and preserve_thinking take the values the "
                            "loaded template can render", _edits(*thinking))]
    if not caps.supports_tools:
        narrowings.append(
            Narrowing(
                "a template without a tool section takes no tool definitions or tool-call history "
                "(Responses hosted tools stay: they never reach the prompt)",
                _edits(
                    ("ChatCompletionRequest.properties.tools", NULL),
                    ("ChatAssistantMessage.properties.tool_calls", NULL),
                    ("ChatMessage.anyOf", [ref("ChatInstructionMessage"), ref("ChatAssistantMessage")]),
                    ("ResponsesTool.anyOf", [ref("HostedTool")]),
                    *((f"{name}.properties.tools", NULL) for name in MESSAGES_REQUESTS),
                ),
            )
        )
    return narrowings


# With --vision the narrowings above keep the user messages that carry media.
VISION_NARROWINGS: list[Narrowing] = [
    Narrowing(
        "with --vision: user messages with media parts stay among the messages and Items the narrowings keep; "
        "at most four blocks carry cache_control (image blocks too)",
        _edits(
            ("ChatMessage.anyOf", [ref("ChatInstructionMessage"), ref("ChatUserMessage"), ref("ChatAssistantMessage"),
                                   ref("ChatToolMessage")]),
            ("UserMessageItem.properties.id", NULL),
            ("InputItem.anyOf", [ref("InstructionMessageItem"), ref("UserMessageItem"), ref("AssistantMessageItem")]),
            ("UserMessage.properties.content.anyOf.1.items", {"anyOf": [ref("TextBlock"), ref("ImageBlock")]}),
            ("ImageBlock.properties.cache_control", NULL),
        ),
    ),
]


def accepted_document(
    caps: TemplateCapabilities, model_id: str, max_output_tokens: int | None = None, vision: bool = False
) -> dict:
    """The OpenAPI document narrowed (INEXPRESSIBLE and the template's capabilities) so that every
    body it generates is accepted by a server serving `model_id` with `caps` (with --vision when
    `vision`); max_output_tokens bounds the output limits (cheap generation for fuzzing)."""
    document = openapi_document(vision=vision)
    schemas = document["components"]["schemas"]
    schemas["ModelId"] = {"type": "string", "enum": [model_id]}
    for narrowing in [*INEXPRESSIBLE, *(VISION_NARROWINGS if vision else ()), *_capability_narrowings(caps)]:
        narrowing.apply(schemas)
    if max_output_tokens is not None:
        for name, key, low in (("ChatCompletionRequest", "max_tokens", 0),
                               ("ResponseCreateRequest", "max_output_tokens", 0),
                               ("MessagesRequest", "max_tokens", 1)):
            schemas[name]["properties"][key] = nullable(integer(low, max_output_tokens))
    return document


def integer_literals(value):
    """The body with every whole float written as an integer. JSON Schema's integer also matches
    4.0, which the validators refuse as OpenAI and Anthropic do; clients write integer literals."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: integer_literals(item) for key, item in value.items()}
    if isinstance(value, list):
        return [integer_literals(item) for item in value]
    return value
