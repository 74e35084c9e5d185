"""The Chat Completions request in the OpenAPI document, beside the parsers it describes.

ChatCompletionRequest is rendered from request.FIELDS; the shapes below are those messages.py
(messages, parts, tool-call history) and request.py (tools, tool_choice) read, built from their
constants. tests/server/test_openapi.py walks them against the parsers.
"""

from __future__ import annotations

from ninfer.server.openai_chat.messages import ASSISTANT_ONLY_FIELDS, MEDIA_PART_KINDS
from ninfer.server.openai_chat.request import FIELDS
from ninfer.server.validation.cache_markers import CACHE_BREAKPOINT_SCHEMA
from ninfer.server.validation.media import MEDIA_URL
from ninfer.server.validation.schema import (
    NO_ITEMS,
    NON_EMPTY_STRING,
    NULL,
    STRING,
    Schema,
    const,
    enum,
    nullable,
    obj,
    ref,
    unprovidable,
)

# Members only assistant messages carry: elsewhere null or [] (anything else is refused, not dropped).
ASSISTANT_ONLY = {key: {"anyOf": [NULL, NO_ITEMS]} for key in ASSISTANT_ONLY_FIELDS}
TEXT_CONTENT = "A string or text parts"


def _part(kind: str, source: Schema) -> Schema:
    return obj({"type": const(kind), kind: source, "prompt_cache_breakpoint": CACHE_BREAKPOINT_SCHEMA}, ("type", kind))


def _message(role: Schema, content: Schema, required: tuple[str, ...], **members: Schema) -> Schema:
    return obj({"role": role, "content": content, **members, **ASSISTANT_ONLY}, required)


def _tool_name_choice() -> Schema:
    return obj({"type": const("function"), "function": obj({"name": STRING}, ("name",))}, ("type", "function"))


def schemas(vision: bool) -> dict[str, Schema]:
    """The Chat request components; with vision, user and tool messages take image and video parts."""
    media = "media parts: user and tool messages" if vision else (
        "image_url/video_url parts: 400 vision_disabled on a server without --vision; this document describes "
        "that server")
    user_content = ref("ChatUserContent") if vision else ref("ChatContent")
    components: dict[str, Schema] = {
        "ChatTextPart": _part("text", STRING),
        "ChatRefusalPart": _part("refusal", STRING),
        "ChatContent": {"description": f"{TEXT_CONTENT} ({media}).",
                        "anyOf": [STRING, {"type": "array", "items": ref("ChatTextPart")}]},
        "ChatToolCall": obj(
            {
                "id": STRING,
                "type": const("function"),
                "function": obj({"name": NON_EMPTY_STRING, "arguments": ref("JsonObjectText")}, ("name", "arguments")),
            },
            ("function",),
        ),
        "ChatInstructionMessage": _message(
            enum(("system", "developer", "user")), ref("ChatContent"), ("role", "content"),
            name=unprovidable(const(""), "participant names"),
        ),
        "ChatToolMessage": _message(
            const("tool"), user_content, ("role", "content", "tool_call_id"),
            tool_call_id=NON_EMPTY_STRING, name={"type": "string", "description": "mirrors the function name; ignored"},
        ),
        "ChatFunctionMessage": {
            **_message(const("function"), STRING, ("role", "name"), name=NON_EMPTY_STRING),
            "description": "Legacy function result: follows an assistant function_call with the same name.",
        },
        "ChatAssistantMessage": obj(
            {
                "role": const("assistant"),
                "content": {"anyOf": [STRING, {"type": "array", "items": {"anyOf": [ref("ChatTextPart"),
                                                                                    ref("ChatRefusalPart")]}}]},
                "refusal": STRING,
                "reasoning_content": STRING,
                "reasoning": {"type": "string", "description": "alias of reasoning_content; equal when both are given"},
                "tool_calls": {"type": "array", "items": ref("ChatToolCall")},
                "function_call": obj(
                    {"name": NON_EMPTY_STRING, "arguments": ref("JsonObjectText")},
                    ("name", "arguments"),
                    description="legacy; not together with tool_calls",
                ),
                "name": unprovidable(const(""), "participant names"),
                "audio": unprovidable(NULL, "audio output history"),
            },
            ("role",),
        ),
        "ChatMessage": {
            "anyOf": [
                ref("ChatInstructionMessage"),
                *([ref("ChatUserMessage")] if vision else []),
                ref("ChatAssistantMessage"),
                ref("ChatToolMessage"),
                ref("ChatFunctionMessage"),
            ]
        },
        "ChatTool": obj(
            {
                "type": const("function"),
                "function": {
                    "allOf": [
                        ref("FunctionFlags"),
                        obj(
                            {
                                "name": NON_EMPTY_STRING,
                                "description": STRING,
                                "parameters": ref("JsonSchema"),
                                "defer_loading": unprovidable(nullable(const(False)), "deferred tool loading"),
                            },
                            ("name",),
                        ),
                    ]
                },
            },
            ("type", "function"),
            description="A function tool; names are unique within the request.",
        ),
        "ChatToolChoice": {
            "anyOf": [
                enum(("auto", "none", "required"), "required: the answer is one or more calls (a grammar)"),
                {**_tool_name_choice(), "description": "a named, declared tool: the answer is exactly one call of it"},
                obj(
                    {
                        "type": const("allowed_tools"),
                        "allowed_tools": obj(
                            {
                                "mode": enum(("auto", "required")),
                                "tools": {"type": "array", "items": _tool_name_choice(),
                                          "description": "each names a declared tool"},
                            },
                            ("mode", "tools"),
                        ),
                    },
                    ("type", "allowed_tools"),
                ),
            ]
        },
        "ChatCompletionRequest": FIELDS.schema(("messages",), description="Unknown top-level fields are ignored."),
    }
    if vision:
        source = {"anyOf": [MEDIA_URL, obj({"url": MEDIA_URL, "detail": const("auto")}, ("url",))]}
        parts = {f"Chat{kind.title()}Part": _part(field, source)
                 for field, kind in MEDIA_PART_KINDS.items()}
        components |= {
            **parts,
            "ChatUserContent": {"anyOf": [STRING, {"type": "array", "items": {
                "anyOf": [ref("ChatTextPart"), *map(ref, parts)]}}]},
            "ChatUserMessage": _message(const("user"), ref("ChatUserContent"), ("role", "content"),
                                        name=unprovidable(const(""), "participant names")),
        }
    return components
