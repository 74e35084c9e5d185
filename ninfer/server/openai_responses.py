"""OpenAI Responses Core: POST /v1/responses (JSON or semantic SSE), input_tokens, and the local
stored-Response resources (retrieve, delete, input_items; cancel and compact fail explicitly).

Validation and the Item -> prompt step live in openai_responses_request.py, output Items and SSE
events in openai_responses_stream.py, storage in response_store.py, and the prompt, engine and
decoding lifecycle in generation.py. This file wires them to HTTP and decides what is stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ninfer.contract.output import FinishReason
from ninfer.contract.reuse_path import ReusePath
from ninfer.frontend.conversation import Conversation
from ninfer.frontend.prompt_builder import PreparedPrompt, PromptError
from ninfer.server.app import read_json, request_id_of
from ninfer.server.engine_client import Overloaded
from ninfer.server.errors import APIError, invalid, unsupported
from ninfer.server.generation import (
    FinishEvent,
    Generation,
    GenerationOptions,
    ProgressEvent,
    race_disconnect,
)
from ninfer.server.openai_responses_request import (
    ResponsesContext,
    ResponsesRequest,
    build_conversation,
    parse_create,
    parse_input_tokens,
)
from ninfer.server.openai_responses_stream import ResponseAssembler
from ninfer.server.response_store import (
    ResponseStore,
    StoreCapacityExceeded,
    StoredResponse,
    json_size,
    session_key_for,
)
from ninfer.server.serving import Serving
from ninfer.server.sse import event_frame, with_keepalive

# Engine error params name Chat Completions fields; Responses names them differently.
_PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens"}
MAX_LIST_LIMIT, DEFAULT_LIST_LIMIT = 100, 20


async def create(request: Request, serving: Serving) -> Response:
    body = await read_json(request)
    parsed = parse_create(body, _context(serving))
    store = serving.response_store
    parent, conversation = _conversation(store, parsed)
    history_bytes = (parent.history_bytes if parent else 0) + sum(json_size(item) for item in parsed.items)
    if parsed.store and not store.fits(history_bytes):
        raise _capacity_error(f"the conversation needs {history_bytes} bytes; the store holds {store.max_bytes} "
                              f"bytes in at most {store.max_records} records")
    try:
        ticket = serving.engine.reserve()
    except Overloaded as exc:
        raise APIError(429, "the server is at capacity; retry later", code="server_overloaded") from exc
    try:
        prepared = await _prepare(serving, conversation)
        response_id = Generation.new_id("resp_")
        # A stored chain shares one engine session; store:false requests stay anonymous so they
        # read the chain's checkpoints by exact prefix without becoming its latest endpoint.
        session_key = None
        if parsed.store:
            session_key = parent.session_key if parent else session_key_for(response_id)
        options = GenerationOptions(
            max_tokens=parsed.max_output_tokens,
            sampling=parsed.sampling,
            tools=parsed.callable_tools or None,
            session_key=session_key,
            endpoint_path=ReusePath.PRIVATE_RESPONSE_REPLAY if session_key else ReusePath.PRIVATE_ENDPOINT,
        )
        generation = Generation(serving, request_id_of(request), prepared, options, ticket)
        await race_disconnect(request.receive, _start(generation))
    except BaseException:
        ticket.release()
        raise
    run = _Run(store, parsed, parent, prepared, generation, session_key, history_bytes, response_id)
    if parsed.stream:
        return StreamingResponse(
            with_keepalive(_stream(run, ticket)),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache"},
        )
    try:
        payload = await race_disconnect(request.receive, _aggregate(run))
    finally:
        ticket.release()
    return JSONResponse(payload)


async def input_tokens(request: Request, serving: Serving) -> Response:
    body = await read_json(request)
    parsed = parse_input_tokens(body, _context(serving))
    _, conversation = _conversation(serving.response_store, parsed)
    prepared = await _prepare(serving, conversation, with_capture_hints=False)
    return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prepared.token_ids)})


async def compact(request: Request, serving: Serving) -> Response:
    raise APIError(
        400,
        "NInfer cannot compact conversations; keep the history or summarise it client-side",
        code="compaction_not_supported",
    )


async def retrieve(request: Request, serving: Serving, response_id: str) -> Response:
    query = request.query_params
    if query.get("stream", "false").lower() not in ("false", "0"):
        raise unsupported("stream", "NInfer cannot provide stream recovery of a finished response")
    if query.get("starting_after") is not None:
        raise unsupported("starting_after", "NInfer cannot provide stream recovery of a finished response")
    _reject_include(request)
    return JSONResponse(_stored(serving.response_store, response_id).response)


async def delete(request: Request, serving: Serving, response_id: str) -> Response:
    if not serving.response_store.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def input_items(request: Request, serving: Serving, response_id: str) -> Response:
    query = request.query_params
    _reject_include(request)
    limit_text = query.get("limit", str(DEFAULT_LIST_LIMIT))
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_LIST_LIMIT:
        raise invalid("limit", f"limit must be an integer between 1 and {MAX_LIST_LIMIT}, got {limit_text!r}")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", f"order must be asc or desc, got {order!r}")
    items = list(_stored(serving.response_store, response_id).input_items)
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        position = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if position is None:
            raise invalid("after", f"after {after!r} is not an input Item of response {response_id!r}")
        items = items[position + 1 :]
    page = items[: int(limit_text)]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }
    )


async def cancel(request: Request, serving: Serving, response_id: str) -> Response:
    _stored(serving.response_store, response_id)
    raise APIError(
        400,
        "only background responses can be cancelled, and NInfer does not run responses in the background",
        code="background_not_supported",
    )


# ---- helpers ---------------------------------------------------------------------------------


def _context(serving: Serving) -> ResponsesContext:
    return ResponsesContext(serving.model_id, serving.capabilities)


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response with id {response_id!r}", code="response_not_found")


def _stored(store: ResponseStore, response_id: str) -> StoredResponse:
    record = store.get(response_id)
    if record is None:
        raise _not_found(response_id)
    return record


def _conversation(store: ResponseStore, parsed: ResponsesRequest) -> tuple[StoredResponse | None, Conversation]:
    """The parent record (if any) and the prompt: its stored chain, then this request (create and
    input_tokens share this path, so their token counts agree)."""
    parent = _parent(store, parsed.previous_response_id)
    history = parent.history if parent else []
    return parent, build_conversation(parsed, history, parent.preserve_thinking if parent else None)


def _parent(store: ResponseStore, response_id: str | None) -> StoredResponse | None:
    if response_id is None:
        return None
    record = store.get(response_id)
    if record is None:
        raise APIError(
            404,
            f"previous_response_id {response_id!r} is not a stored response (store:false, deleted or evicted)",
            code="response_not_found",
            param="previous_response_id",
        )
    return record


def _reject_include(request: Request) -> None:
    query = request.query_params
    include = [value for key in ("include", "include[]") for value in query.getlist(key) if value]
    if include:
        raise unsupported("include", f"NInfer cannot provide additional output data ({', '.join(include)})")


def _capacity_error(message: str) -> APIError:
    return APIError(400, message, code="response_store_capacity_exceeded", param="store")


async def _prepare(serving: Serving, conversation: Conversation, with_capture_hints: bool = True) -> PreparedPrompt:
    try:
        return await asyncio.to_thread(serving.prompt_builder.build, conversation, with_capture_hints)
    except PromptError as exc:
        raise APIError(400, str(exc), code="invalid_prompt", param="input") from exc


def _renamed(error: APIError) -> APIError:
    error.param = _PARAM_NAMES.get(error.param or "", error.param)
    return error


async def _start(generation: Generation) -> None:
    try:
        await generation.start()
    except APIError as error:
        raise _renamed(error) from None


class _Run:
    """One admitted create: folds the generation into Items and stores the terminal Response."""

    def __init__(
        self,
        store: ResponseStore,
        parsed: ResponsesRequest,
        parent: StoredResponse | None,
        prepared: PreparedPrompt,
        generation: Generation,
        session_key: str | None,
        history_bytes: int,
        response_id: str,
    ):
        self.store = store
        self.parsed = parsed
        self.parent = parent
        self.prepared = prepared
        self.generation = generation
        self.session_key = session_key
        self.history_bytes = history_bytes
        self.failure: APIError | None = None
        sampling = generation.sampling
        config = {**parsed.echo, "temperature": sampling.temperature, "top_p": sampling.top_p}
        self.assembler = ResponseAssembler(response_id, config, parsed.functions)

    def usage(self) -> dict[str, Any]:
        usage = self.generation.usage
        return {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.total_tokens,
        }

    def finish(self, event: FinishEvent) -> list[dict]:
        """Close the output, store it when asked, and end with exactly one terminal event."""
        if event.reason not in (FinishReason.STOP, FinishReason.LENGTH):
            self.failure = APIError(500, f"generation ended without a result ({event.reason.value})",
                                    code="server_error")
            return self.assembler.fail(self.failure, self.usage())
        incomplete = event.reason is FinishReason.LENGTH
        events = self.assembler.finish_output(incomplete, self.generation.decoder.reasoning_open)
        response = self.assembler.snapshot("incomplete" if incomplete else "completed", self.usage())
        try:
            self._save(response)
        except StoreCapacityExceeded as exc:
            self.failure = _capacity_error(str(exc))
            response = self.assembler.snapshot("failed", self.usage(), self.failure)
        return [*events, self.assembler.terminal(response)]

    def _save(self, response: dict[str, Any]) -> None:
        if not self.parsed.store:
            return
        output = self.assembler.output
        history = [*(self.parent.history if self.parent else []), *self.parsed.items, *output]
        record = StoredResponse(
            response=response,
            input_items=self.parsed.items,
            history=history,
            history_bytes=self.history_bytes + sum(json_size(item) for item in output),
            preserve_thinking=self.prepared.preserve_thinking,
            session_key=self.session_key,
        )
        self.store.put(record)


async def _aggregate(run: _Run) -> dict[str, Any]:
    try:
        async for event in run.generation.events():
            if isinstance(event, FinishEvent):
                terminal = run.finish(event)[-1]
                if run.failure is not None:
                    raise run.failure  # no stream has started: the failure is an ordinary HTTP error
                return terminal["response"]
            if not isinstance(event, ProgressEvent):
                run.assembler.feed(event)
    except APIError as error:
        raise _renamed(error) from None
    raise APIError(500, "the generation ended without a finish event", code="internal_error")


async def _stream(run: _Run, ticket) -> AsyncIterator[bytes]:
    assembler = run.assembler
    try:
        for payload in assembler.begin():
            yield _frame(payload)
        async for event in run.generation.events():
            if isinstance(event, ProgressEvent):
                continue
            if isinstance(event, FinishEvent):
                for payload in run.finish(event):
                    yield _frame(payload)
                return
            for payload in assembler.feed(event):
                yield _frame(payload)
    except APIError as error:
        for payload in assembler.fail(_renamed(error), run.usage()):
            yield _frame(payload)
    finally:
        ticket.release()


def _frame(payload: dict) -> bytes:
    return event_frame(payload["type"], payload)
