"""The one endpoint lifecycle every generation route runs, and the seam a protocol plugs into.

parse -> reserve a place -> build the prompt -> start the generation under a disconnect watch
(admission errors stay ordinary HTTP errors) -> stream frames or fold an aggregate body ->
release the place. A protocol supplies three things: how to parse its body (`Protocol.parse`),
how its errors and statuses differ (`Protocol.map_error`), and its wire format (a `Wire` per
request, which the stream and the aggregate drive with the same events, so both agree).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ninfer.contract.constraint import OutputConstraint
from ninfer.frontend.answer_format import AnswerFormatError
from ninfer.frontend.conversation import Conversation
from ninfer.frontend.prompt_builder import PreparedPrompt, PromptError
from ninfer.server.engine_client import Overloaded
from ninfer.server.errors import APIError
from ninfer.server.generation import FinishEvent, Generation, GenerationOptions, ProgressEvent, race_disconnect
from ninfer.server.http import read_json, request_id_of
from ninfer.server.request_record import RequestRecord
from ninfer.server.routing_key import ROUTING_KEY_HEADER, header_value
from ninfer.server.served_model import ServedModel
from ninfer.server.sse import with_keepalive

log = logging.getLogger("ninfer.server")


@dataclass
class ParsedRequest:
    """What the lifecycle needs from any protocol's request; protocols subclass it with their own fields."""

    conversation: Conversation
    options: GenerationOptions
    stream: bool = False
    requested_reasoning_effort: str | None = None  # the client's effort as sent, before any mapping (request log)
    routing_key: str | None = None  # the conversation's key for a router in front of replicas (routing_key.py)

    def routing_headers(self) -> dict[str, str]:
        """Response headers a router keeps the conversation on this replica by."""
        return {} if self.routing_key is None else {ROUTING_KEY_HEADER: header_value(self.routing_key)}

    def semantic_change(self, prepared: PreparedPrompt) -> bool | None:
        """Whether this request starts a new semantic branch of a stored chain (Responses only;
        None where the protocol has no chains)."""
        return None


class Wire(abc.ABC):
    """One request's wire format. Every method returns the SSE frames it produces now; the
    aggregate path calls the same methods, ignores the frames and then asks for body()."""

    def begin(self) -> list[bytes]:
        return []

    def progress(self, event: ProgressEvent) -> list[bytes]:
        return []

    @abc.abstractmethod
    def output(self, event: object) -> list[bytes]:
        """A decoder event (reasoning, content, tool-call start/arguments/end)."""

    @abc.abstractmethod
    def finish(self, event: FinishEvent) -> list[bytes]:
        """The generation ended; the stream's closing frames."""

    @abc.abstractmethod
    def error(self, error: APIError) -> list[bytes]:
        """A failure after the stream started, in the protocol's in-stream error shape."""

    @abc.abstractmethod
    def body(self) -> dict[str, Any]:
        """The aggregate response, after finish(); may raise APIError."""


class Protocol(abc.ABC):
    name = "protocol"  # its label in the request log (openai_chat, openai_responses, anthropic_messages)
    prompt_param = "messages"  # the field a prompt-rendering error names

    @abc.abstractmethod
    def parse(self, body: object, serving: ServedModel) -> ParsedRequest:
        """Validate a create body; raises APIError naming the field."""

    @abc.abstractmethod
    def wire(self, parsed: ParsedRequest, generation: Generation, request_id: str) -> Wire: ...

    def parse_count(self, body: object, serving: ServedModel) -> Conversation:
        """Validate a token-count body (the prompt-shaping subset of create)."""
        raise NotImplementedError

    def count_body(self, num_tokens: int) -> dict[str, Any]:
        raise NotImplementedError

    def map_error(self, error: APIError) -> APIError:
        """The protocol's statuses and field names for a lifecycle error (default: unchanged)."""
        return error


async def _parse(request: Request, parse, serving: ServedModel):
    body, large = await read_json(request)
    if large:
        return await asyncio.to_thread(parse, body, serving)
    return parse(body, serving)


async def prepare_prompt(
    serving: ServedModel,
    conversation: Conversation,
    param: str,
    with_capture_hints: bool = True,
    deadline: float | None = None,
) -> PreparedPrompt:
    """The rendered prompt's token ids, with its media acquired, prepared and expanded.
    deadline: time.monotonic() by which preparation must end (the request's pending deadline)."""
    media = serving.prompt_media
    refs, stats = [], {}
    if media is not None:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        refs, stats = await media.prepare(conversation, left)
    try:
        try:
            prepared = await asyncio.to_thread(serving.prompt_builder.build, conversation, with_capture_hints)
        except PromptError as exc:
            raise APIError(400, str(exc), code="invalid_prompt", param=param) from exc
        return media.expand(prepared, refs, stats, param) if refs else prepared
    finally:
        for ref in refs:
            ref.release()


async def compile_answer(serving: ServedModel, options: GenerationOptions, thinking: bool) -> OutputConstraint | None:
    """The request's output constraint, checked on a worker thread (a schema the grammar cannot
    hold is a 400 naming its field); with log probabilities, the vocabulary's token bytes are
    indexed there too, never on the event loop."""
    if options.top_logprobs is not None:
        await asyncio.to_thread(serving.vocabulary.token_bytes, ())
    if options.answer is None:
        return None
    think_end = serving.think_end_token_id if thinking else None
    try:
        return await asyncio.to_thread(options.answer.constraint, think_end)
    except AnswerFormatError as exc:
        message = str(exc) if exc.path in str(exc) else f"{exc.path}: {exc}"
        raise APIError(400, message, code="invalid_schema", param=exc.path) from exc


def reserve(serving: ServedModel):
    try:
        return serving.engine.reserve()
    except Overloaded as exc:
        raise APIError(429, "the server is at capacity; retry later", code="server_overloaded") from exc


async def generate(request: Request, serving: ServedModel, protocol: Protocol) -> Response:
    """POST of a generation endpoint: the whole lifecycle (module docstring)."""
    try:
        parsed = await _parse(request, protocol.parse, serving)
    except APIError as error:
        raise protocol.map_error(error) from None
    request_id = request_id_of(request)
    record = RequestRecord(serving.events, request_id, protocol.name, parsed)
    ticket = None
    try:
        ticket = reserve(serving)
        preparing = prepare_prompt(serving, parsed.conversation, protocol.prompt_param, deadline=ticket.deadline)
        # Fetching and preparing media can take seconds: a client gone meanwhile gives its place back.
        prepared: PreparedPrompt = await (
            race_disconnect(request.receive, preparing) if parsed.conversation.media_parts else preparing
        )
        constraint = await compile_answer(serving, parsed.options, prepared.thinking)
        generation = Generation(serving, request_id, prepared, parsed.options, ticket, record, constraint)
        generation.check_fits()
    except APIError as error:
        mapped = protocol.map_error(error)
        record.rejected(mapped)
        if ticket is not None:
            ticket.release()
        raise mapped from None
    except BaseException:
        record.error("cancelled", message="the client went away during preparation")
        if ticket is not None:
            ticket.release()
        raise
    record.start(generation)
    try:
        await race_disconnect(request.receive, generation.start())
        wire = protocol.wire(parsed, generation, request_id)
    except APIError as error:
        mapped = protocol.map_error(error)
        record.error("admission", mapped)
        ticket.release()
        raise mapped from None
    except BaseException as error:
        record.error("cancelled", message=f"{type(error).__name__} before admission")
        ticket.release()
        raise
    if parsed.stream:
        return StreamingResponse(
            with_keepalive(_stream(protocol, wire, generation, ticket, request_id)),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", **parsed.routing_headers()},
        )
    try:
        payload = await race_disconnect(request.receive, _aggregate(wire, generation))
    except APIError as error:
        mapped = protocol.map_error(error)
        record.error("generation", mapped)
        raise mapped from None
    except BaseException as error:
        record.error("cancelled", message=f"{type(error).__name__} during generation")
        raise
    finally:
        ticket.release()
    return JSONResponse(payload, headers=parsed.routing_headers())


async def count_tokens(request: Request, serving: ServedModel, protocol: Protocol) -> Response:
    """The prompt tokens a create with the same input would use: no engine work, no place taken."""
    try:
        conversation = await _parse(request, protocol.parse_count, serving)
        deadline = time.monotonic() + serving.config.engine.pending_timeout_ms / 1000
        prepared = await prepare_prompt(
            serving, conversation, protocol.prompt_param, with_capture_hints=False, deadline=deadline
        )
    except APIError as error:
        raise protocol.map_error(error) from None
    return JSONResponse(protocol.count_body(len(prepared.token_ids)))


async def _aggregate(wire: Wire, generation: Generation) -> dict[str, Any]:
    async for event in generation.events():
        if isinstance(event, FinishEvent):
            wire.finish(event)
            return wire.body()
        if not isinstance(event, ProgressEvent):
            wire.output(event)
    raise APIError(500, "the generation ended without a finish event", code="internal_error")


async def _stream(protocol: Protocol, wire: Wire, generation: Generation, ticket, request_id: str) -> AsyncIterator[bytes]:
    try:
        for frame in wire.begin():
            yield frame
        async for event in generation.events():
            if isinstance(event, ProgressEvent):
                frames = wire.progress(event)
            elif isinstance(event, FinishEvent):
                frames = wire.finish(event)
            else:
                frames = wire.output(event)
            for frame in frames:
                yield frame
    except APIError as error:
        mapped = protocol.map_error(error)
        generation.record.error("generation", mapped)
        for frame in wire.error(mapped):
            yield frame
    except Exception:
        log.exception("request %s: the stream failed", request_id)
        error = APIError(500, "internal server error", code="internal_error")
        generation.record.error("generation", error)
        for frame in wire.error(error):
            yield frame
    finally:
        # A stream left early (the client went away) ends here without an outcome.
        generation.record.error("cancelled", message="the stream was closed before the generation finished")
        ticket.release()
