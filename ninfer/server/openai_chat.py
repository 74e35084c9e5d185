"""POST /v1/chat/completions: aggregate responses and SSE chunk streams.

Validation lives in openai_chat_request.py; the prompt, engine and decoding lifecycle in
generation.py. This file only shapes the wire objects.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ninfer.contract.output import FinishReason
from ninfer.frontend.output_decoder import ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallStart
from ninfer.frontend.prompt_builder import PromptError
from ninfer.server.app import read_json, request_id_of
from ninfer.server.engine_client import Overloaded
from ninfer.server.errors import APIError
from ninfer.server.generation import FinishEvent, Generation, GenerationOptions, ProgressEvent, race_disconnect
from ninfer.server.openai_chat_request import ChatContext, ChatRequest, parse_chat_request
from ninfer.server.serving import Serving
from ninfer.server.sse import DONE_FRAME, data_frame, with_keepalive

log = logging.getLogger("ninfer.server")


async def create(request: Request, serving: Serving) -> Response:
    body = await read_json(request)
    chat = parse_chat_request(body, ChatContext(serving.model_id, serving.capabilities))
    try:
        ticket = serving.engine.reserve()
    except Overloaded as exc:
        raise APIError(429, "the server is at capacity; retry later", code="server_overloaded") from exc
    try:
        try:
            prepared = await asyncio.to_thread(serving.prompt_builder.build, chat.conversation)
        except PromptError as exc:
            raise APIError(400, str(exc), code="invalid_prompt", param="messages") from exc
        completion_id = Generation.new_id("chatcmpl-")
        options = GenerationOptions(
            max_tokens=chat.max_tokens,
            sampling=chat.sampling,
            stop=chat.stop,
            tools=chat.callable_tools if chat.tools_enabled else None,
        )
        generation = Generation(serving, request_id_of(request), prepared, options, ticket)
        await race_disconnect(request.receive, generation.start())
    except BaseException:
        ticket.release()
        raise
    shaper = _ChunkShaper(completion_id, serving.model_id, chat, generation)
    if chat.stream:
        return StreamingResponse(
            with_keepalive(_stream(shaper, ticket)),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache"},
        )
    try:
        payload = await race_disconnect(request.receive, _aggregate(shaper))
    finally:
        ticket.release()
    return JSONResponse(payload)


class _ChunkShaper:
    """Wire shapes of one completion (aggregate and streamed agree by construction)."""

    def __init__(self, completion_id: str, model: str, chat: ChatRequest, generation: Generation):
        self.id = completion_id
        self.model = model
        self.chat = chat
        self.generation = generation
        self.created = int(time.time())
        self.calls: list[dict] = []
        self.reasoning: list[str] = []
        self.content: list[str] = []

    def finish_reason(self, event: FinishEvent) -> str:
        if event.reason is FinishReason.LENGTH:
            return "length"
        return "tool_calls" if self.calls else "stop"

    def usage(self) -> dict:
        usage = self.generation.usage
        return {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        }

    def chunk(self, delta: dict | None, finish_reason: str | None = None, **extra) -> dict:
        choices = [] if delta is None else [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        ]
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def record(self, event: object) -> dict | None:
        """Fold a decoder event into the aggregate state; returns its streaming delta."""
        if isinstance(event, ReasoningDelta):
            self.reasoning.append(event.text)
            return {"reasoning_content": event.text}
        if isinstance(event, ContentDelta):
            self.content.append(event.text)
            return {"content": event.text}
        if isinstance(event, ToolCallStart):
            call_id = Generation.new_id("call_")
            self.calls.append({"id": call_id, "type": "function", "function": {"name": event.name, "arguments": ""}})
            return {
                "tool_calls": [
                    {"index": event.index, "id": call_id, "type": "function",
                     "function": {"name": event.name, "arguments": ""}}
                ]
            }
        if isinstance(event, ToolCallArgumentsDelta):
            self.calls[event.index]["function"]["arguments"] += event.text
            return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
        return None

    def message(self) -> dict:
        content = "".join(self.content)
        message: dict = {"role": "assistant", "content": content if content or not self.calls else None}
        if self.generation.prepared.thinking:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = self.calls
        message["refusal"] = None
        return message


async def _aggregate(shaper: _ChunkShaper) -> dict:
    finish: FinishEvent | None = None
    async for event in shaper.generation.events():
        if isinstance(event, FinishEvent):
            finish = event
        else:
            shaper.record(event)
    assert finish is not None
    return {
        "id": shaper.id,
        "object": "chat.completion",
        "created": shaper.created,
        "model": shaper.model,
        "choices": [
            {"index": 0, "message": shaper.message(), "logprobs": None, "finish_reason": shaper.finish_reason(finish)}
        ],
        "usage": shaper.usage(),
        "timings": shaper.generation.timings().to_dict(),
    }


async def _stream(shaper: _ChunkShaper, ticket) -> AsyncIterator[bytes]:
    chat = shaper.chat
    generation = shaper.generation
    try:
        yield data_frame(shaper.chunk({"role": "assistant", "content": ""}))
        async for event in generation.events():
            if isinstance(event, ProgressEvent):
                if chat.return_progress:
                    progress = event.progress
                    yield data_frame(
                        shaper.chunk(
                            None,
                            prompt_progress={
                                "total": progress.total,
                                "cache": progress.cache,
                                "processed": progress.processed,
                                "time_ms": round(progress.time_ms),
                            },
                        )
                    )
                continue
            if isinstance(event, FinishEvent):
                timings = generation.timings().to_dict()
                finish_extra = {} if chat.include_usage else {"timings": timings}
                yield data_frame(shaper.chunk({}, shaper.finish_reason(event), **finish_extra))
                if chat.include_usage:
                    yield data_frame(shaper.chunk(None, usage=shaper.usage(), timings=timings))
                yield DONE_FRAME
                return
            delta = shaper.record(event)
            if delta is None:
                continue
            extra = {"timings": generation.timings().to_dict()} if chat.timings_per_token else {}
            yield data_frame(shaper.chunk(delta, **extra))
    except APIError as error:
        yield data_frame(error.openai_body())
    finally:
        ticket.release()
