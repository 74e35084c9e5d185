"""The Messages request in the OpenAPI document, beside the parsers it describes.

MessagesRequest and MessagesCountTokensRequest are rendered from request.CREATE_FIELDS and
PROMPT_FIELDS; the shapes below are those lowering.py (blocks, tools, cache markers) and
request.py (thinking, tool_choice, output formats) read, built from their constants.
tests/server/test_openapi.py walks them against the parsers.
"""

from __future__ import annotations

from ninfer.server.anthropic_messages.lowering import CACHE_TTLS, IMAGE_MEDIA_TYPES, TOOL_NAME
from ninfer.server.anthropic_messages.request import CREATE_FIELDS, MIN_THINKING_BUDGET, PROMPT_FIELDS
from ninfer.server.validation.media import MEDIA_URL
from ninfer.server.validation.schema import (
    BOOLEAN,
    EMPTY,
    NON_EMPTY_STRING,
    NULL,
    OBJECT,
    STRING,
    Schema,
    const,
    described,
    enum,
    integer,
    obj,
    ref,
    unprovidable,
)

CACHE_CONTROL = obj({"type": const("ephemeral"), "ttl": enum(CACHE_TTLS)}, ("type",))
NO_TOOLSET = {"toolset_name": unprovidable(NULL, "toolsets")}
UNKNOWN_IGNORED = "Unknown top-level fields are ignored."
SINGLE_TOOL_USE = {"disable_parallel_tool_use": {"type": "boolean",
                                                  "description": "true: at most one tool_use (a grammar)"}}



def schemas(vision: bool) -> dict[str, Schema]:
    """The Messages request components; with vision, user messages and tool results take image blocks."""
    components: dict[str, Schema] = {
        "CacheControl": CACHE_CONTROL,
        "TextBlock": obj(
            {
                "type": const("text"),
                "text": STRING,
                "cache_control": ref("CacheControl"),
                "citations": unprovidable(EMPTY, "citations"),
            },
            ("type", "text"),
        ),
        "ThinkingBlock": obj(
            {
                "type": const("thinking"),
                "thinking": STRING,
                "signature": STRING,
                "cache_control": {**NULL, "description": "thinking blocks carry no cache_control"},
            },
            ("type", "thinking"),
        ),
        "ToolUseBlock": obj(
            {
                "type": const("tool_use"),
                "id": NON_EMPTY_STRING,
                "name": NON_EMPTY_STRING,
                "input": OBJECT,
                "caller": obj({"type": unprovidable(const("direct"), "programmatic tool callers")}, ("type",)),
                "cache_control": ref("CacheControl"),
                **NO_TOOLSET,
            },
            ("type", "id", "name", "input"),
        ),
        "ToolResultBlock": obj(
            {
                "type": const("tool_result"),
                "tool_use_id": STRING,
                "is_error": BOOLEAN,
                "content": {
                    "anyOf": [
                        STRING,
                        {
                            "type": "array",
                            "items": {
                                "anyOf": [
                                    ref("TextBlock"),
                                    obj({"type": const("tool_reference"), "tool_name": STRING}, ("type", "tool_name")),
                                ]
                            },
                        },
                    ]
                },
                "cache_control": ref("CacheControl"),
                **NO_TOOLSET,
            },
            ("type", "tool_use_id"),
            description="Leads its user turn and answers a tool_use of the preceding assistant turn.",
        ),
        "UserMessage": obj(
            {
                "role": const("user"),
                "content": {
                    "anyOf": [STRING, {"type": "array", "items": {"anyOf": [ref("TextBlock"), ref("ToolResultBlock")]}}]
                },
            },
            ("role", "content"),
            description="image blocks are 400 vision_disabled without --vision (this document describes a server "
                        "without it).",
        ),
        "AssistantMessage": obj(
            {
                "role": const("assistant"),
                "content": {
                    "anyOf": [
                        STRING,
                        {
                            "type": "array",
                            "items": {"anyOf": [ref("TextBlock"), ref("ThinkingBlock"), ref("ToolUseBlock")]},
                        },
                    ]
                },
            },
            ("role", "content"),
            description="A final text-only assistant turn is a prefill the answer continues.",
        ),
        "SystemMessage": obj(
            {"role": const("system"), "content": {"anyOf": [STRING, {"type": "array", "items": ref("TextBlock")}]}},
            ("role", "content"),
        ),
        "MessagesTool": {
            "allOf": [
                ref("FunctionFlags"),
                obj(
                    {
                        "type": unprovidable(const("custom"), "Anthropic-provided tools and toolsets"),
                        "name": {"type": "string", "pattern": TOOL_NAME.pattern},
                        "description": STRING,
                        "input_schema": {
                            "type": "object",
                            "properties": {"type": const("object"),
                                           "examples": {"description": "not together with input_examples"}},
                        },
                        "input_examples": {"type": "array", "items": OBJECT},
                        "defer_loading": BOOLEAN,
                        "eager_input_streaming": BOOLEAN,
                        "cache_control": ref("CacheControl"),
                    },
                    ("name", "input_schema"),
                    description="Names are unique; input_examples and input_schema.examples exclude each other.",
                ),
            ]
        },
        "MessagesThinking": {
            "anyOf": [
                obj({"type": const("disabled")}, ("type",)),
                obj(
                    {
                        "type": const("enabled"),
                        "budget_tokens": {
                            **integer(MIN_THINKING_BUDGET),
                            "description": "less than max_tokens",
                        },
                        "display": enum(("summarized", "omitted")),
                    },
                    ("type", "budget_tokens"),
                ),
                obj({"type": const("adaptive"), "display": enum(("summarized", "omitted"))}, ("type",)),
            ]
        },
        "MessagesToolChoice": {
            "anyOf": [
                obj({"type": enum(("auto", "any"), "any: one or more tool_use blocks"), **SINGLE_TOOL_USE}, ("type",)),
                obj({"type": const("tool"), "name": described(STRING, "a declared tool: exactly one call of it"),
                     **SINGLE_TOOL_USE}, ("type", "name")),
                obj({"type": const("none")}, ("type",)),
            ]
        },
        "MessagesOutputFormat": obj(
            {"type": const("json_schema"), "schema": ref("JsonSchema"), "name": NON_EMPTY_STRING, "description": STRING,
             "strict": BOOLEAN},
            ("type", "schema"),
            description="Structured Outputs: the answer text is one JSON value of the schema",
        ),
        "MessagesRequest": CREATE_FIELDS.schema(("model", "messages"), description=UNKNOWN_IGNORED),
        "MessagesCountTokensRequest": PROMPT_FIELDS.schema(("model", "messages"), description=UNKNOWN_IGNORED),
    }
    if vision:
        components["ImageBlock"] = obj(
            {
                "type": const("image"),
                "source": {
                    "anyOf": [
                        obj({"type": const("base64"), "media_type": enum(IMAGE_MEDIA_TYPES), "data": STRING},
                            ("type", "media_type", "data")),
                        obj({"type": const("url"), "url": MEDIA_URL}, ("type", "url")),
                    ]
                },
                "cache_control": ref("CacheControl"),
            },
            ("type", "source"),
        )
        user = components["UserMessage"]
        user["properties"]["content"]["anyOf"][1]["items"]["anyOf"].append(ref("ImageBlock"))
        user["description"] = "Text, tool_result and image blocks."
        result = components["ToolResultBlock"]["properties"]["content"]["anyOf"][0]["anyOf"][1]
        result["items"]["anyOf"].append(ref("ImageBlock"))
    return components
