"""POST /v1/messages and /v1/messages/count_tokens.

Anthropic's statuses differ from OpenAI's for local capacity: overload is 529 and an
admission (or media) timeout is 504. The middleware adds the request-id header and renders
errors with request_id in Anthropic's envelope.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ninfer.frontend.conversation import Conversation
from ninfer.server import endpoint
from ninfer.server.anthropic_messages.request import MessagesRequest, parse_messages_request
from ninfer.server.anthropic_messages.wire import MessagesWire
from ninfer.server.endpoint import Protocol
from ninfer.server.errors import APIError
from ninfer.server.generation import Generation
from ninfer.server.served_model import ServedModel

log = logging.getLogger("ninfer.server")

OVERLOADED = 529  # Anthropic's status for a saturated service
TIMEOUT = 504


class MessagesProtocol(Protocol):
    name = "anthropic_messages"
    prompt_param = "messages"

    def parse(self, body: object, serving: ServedModel) -> MessagesRequest:
        parsed = parse_messages_request(body, serving.request_context)
        for note in parsed.notes:
            log.info("compatibility: %s", note)
        return parsed

    def wire(self, parsed: MessagesRequest, generation: Generation, request_id: str) -> MessagesWire:
        return MessagesWire(Generation.new_id("msg_"), parsed, generation, request_id)

    def parse_count(self, body: object, serving: ServedModel) -> Conversation:
        return parse_messages_request(body, serving.request_context, count_only=True).conversation

    def count_body(self, num_tokens: int) -> dict[str, Any]:
        return {"input_tokens": num_tokens}

    def map_error(self, error: APIError) -> APIError:
        if error.code == "server_overloaded":
            return APIError(OVERLOADED, error.message, code=error.code, param=error.param)
        if error.code == "request_queue_timeout":
            return APIError(TIMEOUT, error.message, code=error.code, param=error.param)
        return error


def register(app: FastAPI, serving: ServedModel) -> None:
    protocol = MessagesProtocol()

    @app.post("/v1/messages")
    async def create(request: Request) -> Response:
        return await endpoint.generate(request, serving, protocol)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await endpoint.count_tokens(request, serving, protocol)
