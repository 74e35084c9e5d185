"""The OpenAPI 3.1 document served at GET /openapi.json: every route, its request body and responses.

Request schemas come from the protocols' own request definitions: each request's top-level
fields are one table (`Fields`) in its request.py that the validator reads its plain options
through and the document renders, and the shapes their parsers read (messages, Items, blocks,
tools) are built beside them in openai_chat/schema.py, openai_responses/schema.py and
anthropic_messages/schema.py from the parsers' constants. This module adds what every protocol
shares, the response bodies, the paths and their errors. tests/server/test_openapi.py walks every
request schema against its validator member by member, and generates bodies from the schemas.

A schema describes what is *accepted*: options that are only ever refused (n > 1, audio; media,
as on a server without --vision) appear as their one neutral value, with the refusal in the
description. JSON schemas inside requests (output formats, tool parameters) are any object here:
one the grammar cannot hold is a 400 invalid_schema naming its field at preparation, after the
body passed. What JSON Schema cannot say (cross-field rules, JSON text inside strings, state such
as stored Responses, the loaded template's capabilities) is listed in
ninfer/testing/openapi_cases.py. The document is the same for every server but for media: the
model id is `ModelId`, any non-empty string here, which must equal the id GET /v1/models lists.
"""

from __future__ import annotations

import copy
import functools

from ninfer.server.anthropic_messages import schema as messages_schema
from ninfer.server.openai_chat import schema as chat_schema
from ninfer.server.openai_responses import schema as responses_schema
from ninfer.server.validation.schema import BOOLEAN, NULL, OBJECT, STRING, Schema, const, enum, integer, obj, ref
from ninfer.server.validation.tools import FUNCTION_FLAGS

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
    "FunctionFlags": FUNCTION_FLAGS.schema(
        description="Tool-definition flags every protocol refuses when they ask for something."
    ),
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

# ---- response bodies ------------------------------------------------------------------------------

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

MESSAGES_RESPONSES: dict[str, Schema] = {
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


@functools.cache
def _document(vision: bool) -> Schema:
    requests = {**chat_schema.schemas(vision), **responses_schema.schemas(vision), **messages_schema.schemas(vision)}
    schemas = copy.deepcopy({**SHARED, **requests, **CHAT_RESPONSES, **RESPONSES_RESPONSES, **MESSAGES_RESPONSES,
                             "Model": MODEL})
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
