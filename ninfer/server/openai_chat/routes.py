"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ninfer.server import endpoint
from ninfer.server.endpoint import Protocol
from ninfer.server.generation import Generation
from ninfer.server.openai_chat.request import ChatRequest, parse_chat_request
from ninfer.server.openai_chat.wire import ChatWire
from ninfer.server.served_model import ServedModel


class ChatProtocol(Protocol):
    name = "openai_chat"
    prompt_param = "messages"

    def parse(self, body: object, serving: ServedModel) -> ChatRequest:
        return parse_chat_request(body, serving.request_context)

    def wire(self, parsed: ChatRequest, generation: Generation, request_id: str) -> ChatWire:
        return ChatWire(Generation.new_id("chatcmpl-"), generation.serving.model_id, parsed, generation)


def register(app: FastAPI, serving: ServedModel) -> None:
    protocol = ChatProtocol()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await endpoint.generate(request, serving, protocol)
