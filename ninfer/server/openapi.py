"""The OpenAPI 3.1 document served at GET /openapi.json: every route, its request body and responses.

Request validation is hand-written (openai_chat/request.py, openai_responses/request.py and
items.py, anthropic_messages/request.py and lowering.py, validation/*), so this document is
written beside it from the same constants and tested against it (tests/server/test_openapi.py):
bodies generated from a request schema are accepted by its validator, and the bodies the
validator accepts in the tests validate against the schema. A schema describes what is
*accepted*: options that are only ever refused (n > 1, JSON modes; media, as on a server without --vision)
appear as their one neutral value, with the refusal in the description. JSON schemas inside
requests (output formats, tool parameters) are any object here: one the grammar cannot hold is a
400 invalid_schema naming its field at preparation, after the body passed.

What JSON Schema cannot say (cross-field rules, JSON text inside strings, state such as stored
Responses, the loaded template's capabilities) is listed in ninfer/testing/openapi_cases.py.
The document is the same for every server: the model id is `ModelId`, any non-empty string
here, which must equal the id GET /v1/models lists.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from ninfer.contract.sampling import TOP_K_CAP
from ninfer.frontend.capabilities import EFFORT_TIERS
from ninfer.server.anthropic_messages import lowering as messages_lowering
from ninfer.server.anthropic_messages import request as messages_request
from ninfer.server.openai_chat import schema as chat_schema
from ninfer.server.openai_responses import schema as responses_schema
from ninfer.server.validation.cache_markers import CACHE_TTLS, PROMPT_CACHE_RETENTIONS
from ninfer.server.validation.sampling import SEED_MAX, SEED_MIN
from ninfer.server.validation.tools import HOSTED_TOOL_TYPES
from ninfer.server.validation.schema import (
    BOOLEAN,
    EMPTY,
    NON_EMPTY_STRING,
    NULL,
    OBJECT,
    STRING,
    Schema,
    const,
    enum,
    integer,
    nullable,
    number,
    obj,
    ref,
    unprovidable,
)

# ---- shared pieces --------------------------------------------------------------------------------

SHARED: dict[str, Schema] = {
    "ModelId": {
        "type": "string",
        "minLength": 1,
        "description": "The served model's public id, as GET /v1/models lists it (404 model_not_found otherwise).",
    },
    "JsonObjectText": {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"type": "object"},
        "description": "A JSON object as text (tool-call arguments); NaN and Infinity are refused.",
    },
    "FunctionFlags": {
        "description": "Tool-definition flags every protocol refuses when they ask for something.",
        "type": "object",
        "properties": {
            "strict": nullable({"type": "boolean", "description": "true: calls of this tool follow its parameters "
                                                                   "schema (a grammar over the Qwen tool-call markup)"}),
            "output_schema": unprovidable(NULL, "function output schemas"),
            "async": unprovidable(nullable(const(False)), "asynchronous function calls"),
            "allowed_callers": nullable(
                {"type": "array", "contains": const("direct"), "description": "must include direct"}
            ),
        },
    },
    "JsonSchema": {
        "type": "object",
        "description": "A JSON Schema the answer or the arguments follow through a grammar; one the grammar cannot "
                       "hold is 400 invalid_schema naming its field.",
    },
    "TokenLogprob": {
        "type": "object",
        "required": ["token", "logprob", "bytes", "top_logprobs"],
        "description": "An answer token: the log-softmax of the logits it was sampled from (after an output "
                       "constraint's mask, before penalties, temperature and top-k/top-p/min-p); bytes are its exact "
                       "UTF-8 bytes. top_logprobs lists fewer than asked where a constraint allows fewer tokens.",
        "properties": {
            "token": STRING,
            "logprob": {"type": "number", "maximum": 0},
            "bytes": {"type": "array", "items": integer(0, 255)},
            "top_logprobs": {
                "type": "array",
                "maxItems": 20,
                "items": {
                    "type": "object",
                    "required": ["token", "logprob", "bytes"],
                    "properties": {"token": STRING, "logprob": {"type": "number"},
                                   "bytes": {"type": "array", "items": integer(0, 255)}},
                },
            },
        },
    },
    "Error": {
        "description": "OpenAI error envelope; `param` names the offending field where one exists.",
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": STRING,
                    "type": STRING,
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
    "AnthropicError": {
        "description": "Anthropic error envelope; the message starts with the offending field where one exists.",
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": const("error"),
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": STRING, "message": STRING},
            },
            "request_id": STRING,
        },
    },
}

# ---- OpenAI Chat Completions ----------------------------------------------------------------------

OPENAI_CACHE_BREAKPOINT = obj({"mode": const("explicit"), "ttl": enum(CACHE_TTLS)}, ("mode",))
PROMPT_CACHE_OPTIONS = obj(
    {"mode": enum(("implicit", "explicit")), "ttl": enum(CACHE_TTLS), "comparison_response_id": STRING}
)

CHAT_RESPONSES: dict[str, Schema] = {
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage", "timings"],
        "properties": {
            "id": STRING,
            "object": const("chat.completion"),
            "created": {"type": "integer"},
            "model": STRING,
            "choices": {
                "type": "array",
                "minItems": 1,
                "maxItems": 1,
                "items": {
                    "type": "object",
                    "required": ["index", "message", "finish_reason"],
                    "properties": {
                        "index": const(0),
                        "logprobs": {
                            "anyOf": [NULL, obj({"content": {"type": "array", "items": ref("TokenLogprob")},
                                                 "refusal": NULL}, ("content",))],
                            "description": "null unless logprobs was true",
                        },
                        "finish_reason": enum(("stop", "length", "tool_calls")),
                        "message": {
                            "type": "object",
                            "required": ["role", "content"],
                            "properties": {
                                "role": const("assistant"),
                                "content": {"type": ["string", "null"]},
                                "reasoning_content": STRING,
                                "tool_calls": {"type": "array", "items": ref("ChatToolCall")},
                                "refusal": NULL,
                            },
                        },
                    },
                },
            },
            "usage": ref("ChatUsage"),
            "timings": {
                "type": "object",
                "description": "llama.cpp's timings: cache_n, prompt_n, rates; draft_n and draft_n_accepted "
                               "when speculative rounds drafted tokens",
            },
        },
    },
    "ChatUsage": {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            "prompt_tokens": integer(0),
            "completion_tokens": integer(0),
            "total_tokens": integer(0),
            "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": integer(0)}},
            "completion_tokens_details": {"type": "object", "properties": {"reasoning_tokens": integer(0)}},
        },
    },
}

# ---- OpenAI Responses -----------------------------------------------------------------------------

RESPONSES_RESPONSES: dict[str, Schema] = {
    "Response": {
        "type": "object",
        "required": ["id", "object", "created_at", "status", "model", "output"],
        "properties": {
            "id": STRING,
            "object": const("response"),
            "created_at": {"type": "integer"},
            "status": enum(("completed", "incomplete", "cancelled", "failed", "in_progress")),
            "model": STRING,
            "output": {"type": "array", "items": {"type": "object", "required": ["type"]}},
            "usage": {"type": ["object", "null"]},
            "error": {"type": ["object", "null"]},
        },
    },
    "InputItemList": {
        "type": "object",
        "required": ["object", "data", "first_id", "last_id", "has_more"],
        "properties": {
            "object": const("list"),
            "data": {"type": "array", "items": {"type": "object"}},
            "first_id": {"type": ["string", "null"]},
            "last_id": {"type": ["string", "null"]},
            "has_more": BOOLEAN,
        },
    },
}

# ---- Anthropic Messages ---------------------------------------------------------------------------

CACHE_CONTROL = obj({"type": const("ephemeral"), "ttl": enum(messages_lowering.CACHE_TTLS)}, ("type",))
NO_TOOLSET = {"toolset_name": unprovidable(NULL, "toolsets")}
SINGLE_TOOL_USE = {"disable_parallel_tool_use": {"type": "boolean", "description": "true: at most one tool_use (a grammar)"}}

MESSAGES: dict[str, Schema] = {
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
        description="image blocks are 400 vision_disabled without --vision (this document describes a server without it).",
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
                    "name": {"type": "string", "pattern": messages_lowering.TOOL_NAME.pattern},
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
                        **integer(messages_request.MIN_THINKING_BUDGET),
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
            obj({"type": const("tool"), "name": {**STRING, "description": "a declared tool: exactly one call of it"},
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
    "Message": {
        "type": "object",
        "required": ["id", "type", "role", "content", "model", "stop_reason", "usage"],
        "properties": {
            "id": STRING,
            "type": const("message"),
            "role": const("assistant"),
            "content": {"type": "array", "items": {"type": "object", "required": ["type"]}},
            "model": STRING,
            "stop_reason": {"type": ["string", "null"]},
            "stop_sequence": {"type": ["string", "null"]},
            "usage": {"type": "object", "required": ["input_tokens", "output_tokens"]},
        },
    },
}


def _messages_request(count_only: bool) -> Schema:
    fields: dict[str, Schema] = {
        "model": {**NON_EMPTY_STRING, "description": "any non-empty label; echoed back, selects nothing"},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [ref("UserMessage"), ref("AssistantMessage"), ref("SystemMessage")]},
        },
        "system": {"anyOf": [STRING, {"type": "array", "items": ref("TextBlock")}]},
        "tools": {"type": "array", "items": ref("MessagesTool")},
        "tool_choice": ref("MessagesToolChoice"),
        "thinking": ref("MessagesThinking"),
        "output_config": obj(
            {
                "effort": enum(messages_request.EFFORTS, "served as the template's nearest tier"),
                "format": ref("MessagesOutputFormat"),
            }
        ),
        "preserve_thinking": BOOLEAN,
        "cache_control": ref("CacheControl"),
        "context_management": obj(
            {
                "edits": {
                    "type": "array",
                    "items": unprovidable(
                        obj({"type": const("clear_thinking_20251015"), "keep": const("all")}, ("type", "keep")),
                        "server-side context editing",
                    ),
                }
            }
        ),
        "output_format": {**ref("MessagesOutputFormat"), "description": "the beta spelling of output_config.format"},
        **{key: unprovidable(EMPTY, capability) for key, capability in messages_request.UNSUPPORTED_FIELDS.items()},
    }
    if not count_only:
        fields |= {
            "max_tokens": {**integer(1), "description": "default --default-max-tokens"},
            "stop_sequences": {"type": "array", "items": NON_EMPTY_STRING},
            "stream": BOOLEAN,
            "temperature": number(0, 1),
            "top_p": number(0, 1),
            "top_k": unprovidable(integer(0, TOP_K_CAP), f"top_k above {TOP_K_CAP}"),
        }
    return obj(fields, ("model", "messages"), description="Unknown top-level fields are ignored.")


MESSAGES["MessagesRequest"] = _messages_request(count_only=False)
MESSAGES["MessagesCountTokensRequest"] = _messages_request(count_only=True)

# ---- paths ------------------------------------------------------------------------------------------

JSON = "application/json"
SSE = "text/event-stream"
CAPACITY = "Retry-After says when to retry"


def _json(schema: Schema, description: str) -> Schema:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _errors(statuses: dict[int, str], anthropic: bool = False) -> dict[str, Schema]:
    error = ref("AnthropicError" if anthropic else "Error")
    return {str(status): _json(error, description) for status, description in statuses.items()}


def _body(name: str) -> Schema:
    return {"required": True, "content": {JSON: {"schema": ref(name)}}}


CLIENT_ERRORS = {
    400: "malformed body or field (param names it), or a capability the server cannot provide",
    401: "missing or invalid API key (with --api-key)",
    413: "body over --max-request-mib",
}
GENERATION_ERRORS = {**CLIENT_ERRORS, 404: "model_not_found", 429: f"server_overloaded; {CAPACITY}",
                     503: f"request_queue_timeout or engine_unavailable; {CAPACITY}"}
MESSAGES_ERRORS = {**CLIENT_ERRORS, 504: f"request_queue_timeout; {CAPACITY}", 529: f"server_overloaded; {CAPACITY}",
                   503: f"engine_unavailable; {CAPACITY}"}
RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": STRING}
NOT_FOUND = {404: "response_not_found"}


def _generation(summary: str, request: str, aggregate: str, errors: dict[str, Schema]) -> Schema:
    return {
        "summary": summary,
        "requestBody": _body(request),
        "responses": {
            "200": {
                "description": "the aggregate body, or a server-sent event stream when stream is true",
                "content": {JSON: {"schema": ref(aggregate)}, SSE: {"schema": STRING}},
            },
            **errors,
        },
    }


MEDIA_PATHS = ("/v1/chat/completions", "/v1/responses", "/v1/responses/input_tokens", "/v1/messages",
               "/v1/messages/count_tokens")


def _paths(vision: bool = False) -> dict[str, Schema]:
    paths = _text_paths()
    if vision:  # media URLs are fetched: their failures are server errors of their own
        for path in MEDIA_PATHS:
            responses = paths[path]["post"]["responses"]
            anthropic = path.startswith("/v1/messages")
            for status, code in ((502, "media_fetch_failed"), (504, "media_fetch_timeout")):
                described = responses.get(str(status), {}).get("description")
                description = f"{described}; or {code}" if described else code
                responses.update(_errors({status: description}, anthropic))
    return paths


def _text_paths() -> dict[str, Schema]:
    public = {"security": []}
    return {
        "/health": {
            "get": {
                "summary": "Engine readiness (no API key needed)",
                **public,
                "responses": {
                    "200": _json(obj({"status": const("ok")}, ("status",)), "the engine can take work"),
                    "503": _json(
                        obj({"status": const("unavailable"), "reason": STRING}, ("status",)),
                        "engine failed, restarting, or stopped restarting",
                    ),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document (no API key needed)",
                **public,
                "responses": {"200": _json(OBJECT, "OpenAPI 3.1")},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus text format",
                "responses": {
                    "200": {"description": "metrics", "content": {"text/plain": {"schema": STRING}}},
                    **_errors({401: CLIENT_ERRORS[401]}),
                },
            }
        },
        "/v1/models": {
            "get": {
                "summary": "The served model",
                "responses": {
                    "200": _json(
                        obj({"object": const("list"), "data": {"type": "array", "items": ref("Model")}},
                            ("object", "data")),
                        "one model",
                    ),
                    **_errors({401: CLIENT_ERRORS[401]}),
                },
            }
        },
        "/v1/models/{model_id}": {
            "get": {
                "summary": "The served model by id",
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": STRING}],
                "responses": {
                    "200": _json(ref("Model"), "the model"),
                    **_errors({401: CLIENT_ERRORS[401], 404: "model_not_found"}),
                },
            }
        },
        "/v1/chat/completions": {
            "post": _generation("OpenAI Chat Completions", "ChatCompletionRequest", "ChatCompletion",
                                _errors(GENERATION_ERRORS))
        },
        "/v1/responses": {
            "post": _generation("OpenAI Responses create", "ResponseCreateRequest", "Response",
                                _errors({**GENERATION_ERRORS, 404: "model_not_found or response_not_found"}))
        },
        "/v1/responses/input_tokens": {
            "post": {
                "summary": "Prompt tokens a create with the same input would use",
                "requestBody": _body("ResponseInputTokensRequest"),
                "responses": {
                    "200": _json(
                        obj({"object": const("response.input_tokens"), "input_tokens": integer(0)},
                            ("object", "input_tokens")),
                        "the count",
                    ),
                    **_errors({**CLIENT_ERRORS, 404: "model_not_found or response_not_found"}),
                },
            }
        },
        "/v1/responses/compact": {
            "post": {
                "summary": "Always refused: no compaction",
                "responses": _errors({400: "compaction_not_supported", 401: CLIENT_ERRORS[401]}),
            }
        },
        "/v1/responses/{response_id}": {
            "get": {
                "summary": "A stored terminal Response",
                "parameters": [
                    RESPONSE_ID,
                    {"name": "stream", "in": "query", "schema": enum(("false", "0")),
                     "description": "stream recovery is unsupported"},
                    {"name": "include", "in": "query", "schema": {"type": "array", "items": STRING, "maxItems": 0}},
                ],
                "responses": {
                    "200": _json(ref("Response"), "the Response"),
                    **_errors({400: "unsupported query option", 401: CLIENT_ERRORS[401], **NOT_FOUND}),
                },
            },
            "delete": {
                "summary": "Remove a stored Response",
                "parameters": [RESPONSE_ID],
                "responses": {
                    "200": _json(
                        obj({"id": STRING, "object": const("response.deleted"), "deleted": const(True)},
                            ("id", "object", "deleted")),
                        "deleted",
                    ),
                    **_errors({401: CLIENT_ERRORS[401], **NOT_FOUND}),
                },
            },
        },
        "/v1/responses/{response_id}/input_items": {
            "get": {
                "summary": "The normalized input Items of a stored Response",
                "parameters": [
                    RESPONSE_ID,
                    {"name": "limit", "in": "query", "schema": integer(1, 100)},
                    {"name": "order", "in": "query", "schema": enum(("asc", "desc"))},
                    {"name": "after", "in": "query", "schema": STRING, "description": "an input Item id"},
                ],
                "responses": {
                    "200": _json(ref("InputItemList"), "a page of Items"),
                    **_errors({400: "invalid query option", 401: CLIENT_ERRORS[401], **NOT_FOUND}),
                },
            }
        },
        "/v1/responses/{response_id}/cancel": {
            "post": {
                "summary": "Always refused: no background responses",
                "parameters": [RESPONSE_ID],
                "responses": _errors({400: "background_not_supported", 401: CLIENT_ERRORS[401], **NOT_FOUND}),
            }
        },
        "/v1/messages": {
            "post": _generation("Anthropic Messages", "MessagesRequest", "Message",
                                _errors(MESSAGES_ERRORS, anthropic=True))
        },
        "/v1/messages/count_tokens": {
            "post": {
                "summary": "Prompt tokens a create with the same input would use",
                "requestBody": _body("MessagesCountTokensRequest"),
                "responses": {
                    "200": _json(obj({"input_tokens": integer(0)}, ("input_tokens",)), "the count"),
                    **_errors(CLIENT_ERRORS, anthropic=True),
                },
            }
        },
    }


MODEL_CAPABILITIES = obj(
    {"vision": {**BOOLEAN, "description": "image and video parts are accepted (--vision)"},
     "tools": {**BOOLEAN, "description": "function tools are accepted (the chat template has a tool section)"},
     "thinking_default": {**BOOLEAN, "description": "a request that says nothing about thinking thinks"},
     "thinking_switch": {**BOOLEAN, "description": "enable_thinking true and false are both served"}},
    ("vision", "tools", "thinking_default", "thinking_switch"),
)
MODEL = obj(
    {"id": STRING, "object": const("model"), "created": {"type": "integer"}, "owned_by": STRING,
     "max_model_len": integer(1), "capabilities": MODEL_CAPABILITIES},
    ("id", "object", "created", "owned_by", "max_model_len", "capabilities"),
)


# ---- media (--vision) -----------------------------------------------------------------------------
# A server with --vision documents its media parts; without it they are 400 vision_disabled and the
# document leaves them out (their descriptions say so).

MEDIA_URL: Schema = {
    "type": "string",
    "pattern": "^([hH][tT][tT][pP][sS]?://|[dD][aA][tT][aA]:)",
    "description": "an http(s) URL (fetched under the server's address rules) or a data: URI",
}


VISION: dict[str, Schema] = {
    "ImageBlock": obj(
        {
            "type": const("image"),
            "source": {
                "anyOf": [
                    obj({"type": const("base64"), "media_type": enum(messages_lowering.IMAGE_MEDIA_TYPES),
                         "data": STRING}, ("type", "media_type", "data")),
                    obj({"type": const("url"), "url": MEDIA_URL}, ("type", "url")),
                ]
            },
            "cache_control": ref("CacheControl"),
        },
        ("type", "source"),
    ),
}


def _with_vision(schemas: dict[str, Schema]) -> None:
    """Media parts where the validators take them with --vision: user and tool messages (Chat),
    user messages and function_call_output (Responses), user messages and tool_result (Messages)."""
    schemas.update(copy.deepcopy(VISION))
    content = schemas["UserMessage"]["properties"]["content"]["anyOf"][1]
    content["items"]["anyOf"].append(ref("ImageBlock"))
    schemas["UserMessage"]["description"] = "Text, tool_result and image blocks."
    result = schemas["ToolResultBlock"]["properties"]["content"]["anyOf"][0]["anyOf"][1]
    result["items"]["anyOf"].append(ref("ImageBlock"))


@functools.cache
def _document(vision: bool) -> Schema:
    schemas = copy.deepcopy({**SHARED, **chat_schema.schemas(vision), **CHAT_RESPONSES, **responses_schema.schemas(vision),
                             **RESPONSES_RESPONSES, **MESSAGES,
                             "Model": MODEL})
    if vision:
        _with_vision(schemas)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "NInfer",
            "version": "1",
            "description": "OpenAI Chat Completions, OpenAI Responses and Anthropic Messages for one served model. "
            "The contract is docs/api.md; what these schemas cannot express is listed in "
            "ninfer/testing/openapi_cases.py.",
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "--api-key"},
                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key", "description": "--api-key"},
            },
        },
        "security": [{"bearer": []}, {"x-api-key": []}],
        "paths": _paths(vision),
    }


def openapi_document(vision: bool = False) -> Schema:
    """A fresh copy of the document (callers may narrow it for testing); vision: a --vision server's."""
    return copy.deepcopy(_document(vision))
