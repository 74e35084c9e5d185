"""The Responses request in the OpenAPI document, beside the parsers it describes.

ResponseCreateRequest and ResponseInputTokensRequest are rendered from request.CREATE_FIELDS and
COUNT_FIELDS; the shapes below are those items.py (input Items and their parts) and tools.py
(tools, tool_choice) read, built from their constants. tests/server/test_openapi.py walks them
against the parsers.
"""

from __future__ import annotations

from ninfer.server.openai_responses.items import ITEM_STATUSES
from ninfer.server.openai_responses.request import COUNT_FIELDS, CREATE_FIELDS, REASONING, TEXT
from ninfer.server.validation.cache_markers import CACHE_BREAKPOINT_SCHEMA
from ninfer.server.validation.media import MEDIA_URL
from ninfer.server.validation.schema import (
    BOOLEAN,
    NON_EMPTY_STRING,
    NULL,
    STRING,
    Schema,
    const,
    enum,
    obj,
    ref,
    unprovidable,
)
from ninfer.server.validation.tools import HOSTED_TOOL_TYPES

ITEM_STATUS = enum(ITEM_STATUSES)
# A create or count needs input, or a previous Response that supplies the conversation.
INPUT_OR_PREVIOUS = [
    {"required": ["input"], "properties": {"input": {"anyOf": [NON_EMPTY_STRING, {"type": "array", "minItems": 1}]}}},
    {"required": ["previous_response_id"], "properties": {"previous_response_id": STRING}},
]
COMPLETED_TOOL_ITEM = {
    "status": unprovidable(const("completed"), "in_progress or incomplete tool Items"),
    "caller": obj({"type": unprovidable(const("direct"), "programmatic tool callers")}, ("type",)),
    "async": unprovidable(const(False), "asynchronous function calls"),
}
ITEM_ID = {**NON_EMPTY_STRING, "description": "kept when given (unique within input), generated otherwise"}
INPUT_TEXT = obj(
    {"type": const("input_text"), "text": STRING, "prompt_cache_breakpoint": CACHE_BREAKPOINT_SCHEMA},
    ("type", "text"),
)


def schemas(vision: bool) -> dict[str, Schema]:
    """The Responses request components; with vision, user messages and tool results take media parts."""
    components: dict[str, Schema] = {
        "InputTextPart": INPUT_TEXT,
        "OutputTextPart": obj(
            {"type": const("output_text"), "text": STRING, "annotations": {"type": "array"}}, ("type", "text")
        ),
        "RefusalPart": obj({"type": const("refusal"), "refusal": STRING}, ("type", "refusal")),
        "InstructionMessageItem": obj(
            {
                "type": const("message"),
                "id": ITEM_ID,
                "role": enum(("user", "system", "developer")),
                "content": {"anyOf": [STRING, {"type": "array", "items": ref("InputTextPart")}]},
                "status": ITEM_STATUS,
                "phase": STRING,
            },
            ("role", "content"),
            description="input_image/input_video parts are 400 vision_disabled without --vision (this document "
                        "describes a server without it).",
        ),
        "AssistantMessageItem": obj(
            {
                "type": const("message"),
                "id": ITEM_ID,
                "role": const("assistant"),
                "content": {
                    "anyOf": [
                        STRING,
                        {
                            "type": "array",
                            "items": {"anyOf": [ref("OutputTextPart"), ref("InputTextPart"), ref("RefusalPart")]},
                        },
                    ]
                },
                "status": ITEM_STATUS,
                "phase": STRING,
            },
            ("role", "content"),
        ),
        "ReasoningItem": obj(
            {
                "type": const("reasoning"),
                "id": ITEM_ID,
                "content": {
                    "type": "array",
                    "items": obj({"type": const("reasoning_text"), "text": STRING}, ("type", "text")),
                },
                "encrypted_content": {
                    "type": "string",
                    "description": "NInfer's envelope of the reasoning text (include reasoning.encrypted_content)",
                },
                "summary": {
                    "type": "array",
                    "items": obj({"type": const("summary_text"), "text": STRING}, ("type", "text")),
                },
                "status": ITEM_STATUS,
            },
            ("type",),
            anyOf=[
                {"required": ["content"], "properties": {"content": {"type": "array", "minItems": 1}}},
                {"required": ["encrypted_content"], "properties": {"encrypted_content": STRING}},
            ],
            description="Raw reasoning text, or NInfer's envelope of it; summaries alone cannot be replayed.",
        ),
        "FunctionCallItem": obj(
            {
                "type": const("function_call"),
                "id": ITEM_ID,
                "call_id": NON_EMPTY_STRING,
                "name": NON_EMPTY_STRING,
                "namespace": STRING,
                "arguments": ref("JsonObjectText"),
                **COMPLETED_TOOL_ITEM,
            },
            ("type", "call_id", "name", "arguments"),
        ),
        "FunctionCallOutputItem": obj(
            {
                "type": const("function_call_output"),
                "id": ITEM_ID,
                "call_id": NON_EMPTY_STRING,
                "output": {"anyOf": [STRING, {"type": "array", "minItems": 1, "items": ref("InputTextPart")}]},
                "name": STRING,
                "namespace": STRING,
                **COMPLETED_TOOL_ITEM,
            },
            ("type", "call_id", "output"),
            description="Answers a call of the preceding assistant turn, in declaration order.",
        ),
        "InputItem": {
            "anyOf": [
                ref("InstructionMessageItem"),
                ref("AssistantMessageItem"),
                ref("ReasoningItem"),
                ref("FunctionCallItem"),
                ref("FunctionCallOutputItem"),
            ]
        },
        "ResponsesFunctionTool": {
            "allOf": [
                ref("FunctionFlags"),
                obj(
                    {
                        "type": const("function"),
                        "name": NON_EMPTY_STRING,
                        "description": STRING,
                        "parameters": ref("JsonSchema"),
                        "defer_loading": unprovidable(const(False), "deferred tool loading"),
                    },
                    ("type", "name"),
                ),
            ]
        },
        "ResponsesTool": {
            "anyOf": [
                ref("ResponsesFunctionTool"),
                obj(
                    {
                        "type": const("namespace"),
                        "name": NON_EMPTY_STRING,
                        "description": STRING,
                        "tools": {"type": "array", "minItems": 1, "items": ref("ResponsesFunctionTool")},
                    },
                    ("type", "name", "tools"),
                ),
                ref("HostedTool"),
            ],
            "description": "Function identities (namespace and name) are unique within the request.",
        },
        "HostedTool": obj(
            {"type": enum(sorted(HOSTED_TOOL_TYPES))},
            ("type",),
            description="Hosted tool: left out of the prompt and echoed back (forcing it is unsupported).",
        ),
        "ResponsesToolChoice": {
            "anyOf": [
                enum(("auto", "none", "required"), "required: the answer is one or more calls (a grammar)"),
                obj(
                    {"type": const("function"), "name": STRING, "namespace": STRING},
                    ("type", "name"),
                    description="a declared function: the answer is exactly one call of it",
                ),
                obj(
                    {
                        "type": const("allowed_tools"),
                        "mode": enum(("auto", "required")),
                        "tools": {
                            "type": "array",
                            "items": obj(
                                {"type": const("function"), "name": STRING, "namespace": STRING}, ("type", "name")
                            ),
                            "description": "each names a declared function",
                        },
                    },
                    ("type", "mode", "tools"),
                ),
            ]
        },
        "ResponsesReasoning": REASONING.schema(),
        "ResponsesText": TEXT.schema(),
        "ResponsesTemplateKwargs": obj(
            {"preserve_thinking": BOOLEAN},
            additionalProperties=unprovidable(NULL, "arbitrary chat template variables"),
        ),
        "ResponseCreateRequest": CREATE_FIELDS.schema(
            ("model",), closed=True, anyOf=INPUT_OR_PREVIOUS,
            description="Unknown top-level fields are 400 unknown_parameter.",
        ),
        "ResponseInputTokensRequest": COUNT_FIELDS.schema(
            closed=True, anyOf=INPUT_OR_PREVIOUS,
            description="The prompt-shaping subset of a create; model is optional.",
        ),
    }
    if vision:
        _with_media(components)
    return components


def _with_media(components: dict[str, Schema]) -> None:
    """Image and video parts where items.py takes them with --vision: user messages and function_call_output."""
    components["InputImagePart"] = obj(
        {"type": const("input_image"), "image_url": MEDIA_URL, "detail": const("auto"),
         "file_id": unprovidable(NULL, "file-id images"), "prompt_cache_breakpoint": CACHE_BREAKPOINT_SCHEMA},
        ("type", "image_url"),
    )
    components["InputVideoPart"] = obj(
        {"type": const("input_video"), "video_url": MEDIA_URL, "prompt_cache_breakpoint": CACHE_BREAKPOINT_SCHEMA},
        ("type", "video_url"),
        description="NInfer extension",
    )
    instruction = components["InstructionMessageItem"]
    instruction["description"] = "Text parts; a user message with media is a UserMessageItem."
    parts = [ref("InputTextPart"), ref("InputImagePart"), ref("InputVideoPart")]
    components["UserMessageItem"] = obj(
        {**instruction["properties"], "role": const("user"),
         "content": {"anyOf": [STRING, {"type": "array", "items": {"anyOf": parts}}]}},
        ("role", "content"),
    )
    components["InputItem"]["anyOf"].insert(1, ref("UserMessageItem"))
    output = components["FunctionCallOutputItem"]["properties"]["output"]
    output["anyOf"][1]["items"] = {"anyOf": parts[:2]}
