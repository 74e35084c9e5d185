"""POST /v1/messages and /v1/messages/count_tokens: Anthropic aggregate responses and SSE.

Validation and prompt lowering live in anthropic_messages_request.py, the content-block
lifecycle in anthropic_messages_stream.py, the engine lifecycle in generation.py. This file
maps statuses to Anthropic's (local overload 529, queue timeout 504) and shapes usage and
stop reasons. The middleware adds the request-id header and renders errors with request_id.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ninfer.contract.output import FinishReason
from ninfer.frontend.prompt_builder import PreparedPrompt, PromptBuilder, PromptError
from ninfer.server.anthropic_messages_request import MessagesContext, MessagesRequest, parse_messages_request
from ninfer.server.anthropic_messages_stream import BlockAssembler, SseEvent
from ninfer.server.app import read_json, request_id_of
from ninfer.server.engine_client import Overloaded, Ticket
from ninfer.server.errors import APIError
from ninfer.server.generation import FinishEvent, Generation, GenerationOptions, ProgressEvent, race_disconnect
from ninfer.server.middleware import anthropic_error_type
from ninfer.server.serving import Serving
from ninfer.server.sse import event_frame, with_keepalive

log = logging.getLogger("ninfer.server")

OVERLOADED = 529  # Anthropic's status for a saturated service
TIMEOUT = 504


async def create(request: Request, serving: Serving) -> Response:
    body = await read_json(request)
    parsed = parse_messages_request(body, _context(serving))
    try:
        ticket = serving.engine.reserve()
    except Overloaded as exc:
        raise APIError(OVERLOADED, "the server is at capacity; retry later", code="server_overloaded") from exc
    try:
        prepared = await _prepare(serving.prompt_builder, parsed, with_capture_hints=True)
        options = GenerationOptions(
            max_tokens=parsed.max_tokens,
            sampling=parsed.sampling,
            stop=parsed.stop_sequences,
            tools=parsed.callable_tools,
            thinking_budget=parsed.thinking_budget,
        )
        generation = Generation(serving, request_id_of(request), prepared, options, ticket)
        try:
            await race_disconnect(request.receive, generation.start())
        except APIError as error:
            raise anthropic_status(error) from error
    except BaseException:
        ticket.release()
        raise
    shaper = _MessageShaper(Generation.new_id("msg_"), parsed, generation)
    if parsed.stream:
        return StreamingResponse(
            with_keepalive(_stream(shaper, ticket, request_id_of(request))),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache"},
        )
    try:
        payload = await race_disconnect(request.receive, _aggregate(shaper))
    except APIError as error:
        raise anthropic_status(error) from error
    finally:
        ticket.release()
    return JSONResponse(payload)


async def count_tokens(request: Request, serving: Serving) -> Response:
    """The prompt tokens a create with the same input would use; no engine work, no ticket."""
    body = await read_json(request)
    parsed = parse_messages_request(body, _context(serving), count_only=True)
    prepared = await _prepare(serving.prompt_builder, parsed, with_capture_hints=False)
    return JSONResponse({"input_tokens": len(prepared.token_ids)})


def anthropic_status(error: APIError) -> APIError:
    """Local admission overload is Anthropic's 529; queue (and media) timeouts are 504."""
    if error.code == "server_overloaded":
        return APIError(OVERLOADED, error.message, code=error.code, param=error.param)
    if error.code == "request_queue_timeout":
        return APIError(TIMEOUT, error.message, code=error.code, param=error.param)
    return error


def _context(serving: Serving) -> MessagesContext:
    return MessagesContext(serving.capabilities, serving.config.default_max_tokens)


async def _prepare(builder: PromptBuilder, parsed: MessagesRequest, *, with_capture_hints: bool) -> PreparedPrompt:
    try:
        return await asyncio.to_thread(builder.build, parsed.conversation, with_capture_hints)
    except PromptError as exc:
        raise APIError(400, str(exc), code="invalid_prompt", param="messages") from exc


class _MessageShaper:
    """Wire shapes of one Message; aggregate and stream share the assembler and the usage."""

    def __init__(self, message_id: str, parsed: MessagesRequest, generation: Generation):
        self.id = message_id
        self.parsed = parsed
        self.generation = generation
        self.blocks = BlockAssembler()

    def usage(self, *, final: bool) -> dict:
        """Anthropic usage: input_tokens excludes the reused prefix; cache creation is unknown (null)."""
        usage = self.generation.usage
        shaped: dict = {
            "input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": None,
            "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens if final else 0,
        }
        if final:
            shaped["output_tokens_details"] = {"thinking_tokens": usage.reasoning_tokens}
        return shaped

    def stop(self, event: FinishEvent) -> tuple[str, str | None]:
        """stop_reason and stop_sequence of a finished generation."""
        if event.reason is FinishReason.LENGTH:
            # The engine clamps the output to the context ceiling; stopping short of max_tokens means that ceiling.
            if self.generation.completion_tokens < self.generation.max_tokens:
                return "model_context_window_exceeded", None
            return "max_tokens", None
        if isinstance(event.stop_reason, str) and event.stop_reason in self.parsed.stop_sequences:
            return "stop_sequence", event.stop_reason
        return ("tool_use" if self.blocks.tool_calls else "end_turn"), None

    def message(self, content: list[dict], stop: tuple[str | None, str | None], *, final: bool) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.parsed.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": self.usage(final=final),
        }


async def _aggregate(shaper: _MessageShaper) -> dict:
    finish: FinishEvent | None = None
    async for event in shaper.generation.events():
        if isinstance(event, FinishEvent):
            finish = event
        elif not isinstance(event, ProgressEvent):
            shaper.blocks.feed(event)
    assert finish is not None
    shaper.blocks.close()
    return shaper.message(shaper.blocks.content, shaper.stop(finish), final=True)


def _frame(event: SseEvent) -> bytes:
    return event_frame(*event)


async def _stream(shaper: _MessageShaper, ticket: Ticket, request_id: str) -> AsyncIterator[bytes]:
    generation = shaper.generation
    try:
        # start() returned after admission committed the reuse choice, so this split is exact.
        start = shaper.message([], (None, None), final=False)
        yield _frame(("message_start", {"type": "message_start", "message": start}))
        yield _frame(("ping", {"type": "ping"}))
        async for event in generation.events():
            if isinstance(event, ProgressEvent):
                continue
            if isinstance(event, FinishEvent):
                for frame in shaper.blocks.close():
                    yield _frame(frame)
                stop_reason, stop_sequence = shaper.stop(event)
                delta = {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": shaper.usage(final=True),
                }
                yield _frame(("message_delta", delta))
                yield _frame(("message_stop", {"type": "message_stop"}))
                return
            for frame in shaper.blocks.feed(event):
                yield _frame(frame)
            if not generation.decoder.reasoning_open:
                for frame in shaper.blocks.end_thinking():
                    yield _frame(frame)
    except APIError as error:
        yield _error_frame(anthropic_status(error), request_id)
    except Exception:
        log.exception("request %s: the Messages stream failed", request_id)
        yield _error_frame(APIError(500, "internal server error", code="internal_error"), request_id)
    finally:
        ticket.release()


def _error_frame(error: APIError, request_id: str) -> bytes:
    payload = {"type": "error", "error": {"type": anthropic_error_type(error), "message": error.message}}
    if request_id:
        payload["request_id"] = request_id
    return event_frame("error", payload)
