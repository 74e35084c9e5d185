"""OpenAI Responses routes: create (JSON or semantic SSE), input_tokens, and the local stored-Response
resources (retrieve, delete, input_items; cancel and compact fail explicitly).

This file wires the request rules (request.py), the Item history (history.py), the output Items
and events (wire.py) and the store (store.py) to the shared endpoint lifecycle, and decides what
is stored: a stored chain shares one engine session, so its checkpoints are preferred when the
next turn arrives; store:false requests stay anonymous and only read by exact prefix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ninfer.contract.output import FinishReason
from ninfer.contract.reuse_path import ReusePath
from ninfer.frontend.conversation import Conversation
from ninfer.frontend.prompt_builder import PreparedPrompt
from ninfer.server import endpoint
from ninfer.server.endpoint import ParsedRequest, Protocol, Wire
from ninfer.server.errors import APIError, invalid, unsupported
from ninfer.server.generation import FinishEvent, Generation, GenerationOptions
from ninfer.server.openai_responses.history import build_conversation
from ninfer.server.openai_responses.request import ResponsesRequest, parse_create, parse_input_tokens
from ninfer.server.openai_responses.store import (
    ResponseStore,
    StoreCapacityExceeded,
    StoredResponse,
    json_size,
    session_key_for,
)
from ninfer.server.openai_responses.wire import ResponseAssembler
from ninfer.server.routing_key import RESPONSE_ID_HEADER
from ninfer.server.served_model import ServedModel
from ninfer.server.sse import event_frame
from ninfer.server.validation.tools import check_template_renders_tools

log = logging.getLogger("ninfer.server")

# Engine error params name Chat Completions fields; Responses names them differently.
_PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens"}
MAX_LIST_LIMIT, DEFAULT_LIST_LIMIT = 100, 20


@dataclass
class ResponsesCreate(ParsedRequest):
    request: ResponsesRequest | None = None
    parent: StoredResponse | None = None
    response_id: str = ""
    session_key: str | None = None
    history_bytes: int = 0

    def routing_headers(self) -> dict[str, str]:
        """The routing key and, for a router that sticks follow-ups to the replica storing their
        parent (previous_response_id), this response's id."""
        return {**super().routing_headers(), RESPONSE_ID_HEADER: self.response_id}

    def semantic_change(self, prepared: PreparedPrompt) -> bool:
        """A child whose resolved preserve_thinking differs from its parent's branches the chain;
        a root, or a child that inherits or repeats the value, does not."""
        return self.parent is not None and prepared.preserve_thinking != self.parent.preserve_thinking


class ResponsesProtocol(Protocol):
    name = "openai_responses"
    prompt_param = "input"

    def parse(self, body: object, serving: ServedModel) -> ResponsesCreate:
        parsed = parse_create(body, serving.request_context)
        store = serving.response_store
        parent, conversation = _conversation(serving, parsed)
        history_bytes = (parent.history_bytes if parent else 0) + sum(json_size(item) for item in parsed.items)
        if parsed.store and not store.fits(history_bytes):
            raise _capacity_error(
                f"the conversation needs {history_bytes} bytes; the store holds {store.max_bytes} "
                f"bytes in at most {store.max_records} records"
            )
        if parsed.omitted_hosted_tools:
            log.info("hosted tools left out of the prompt: %s", ", ".join(parsed.omitted_hosted_tools))
        response_id = Generation.new_id("resp_")
        session_key = None
        if parsed.store:
            session_key = parent.session_key if parent else session_key_for(response_id)
        options = GenerationOptions(
            max_tokens=parsed.max_output_tokens,
            sampling=parsed.sampling,
            tools=parsed.callable_tools or None,
            answer=parsed.answer,
            top_logprobs=parsed.top_logprobs,
            session_key=session_key,
            endpoint_path=ReusePath.PRIVATE_RESPONSE_REPLAY if session_key else ReusePath.PRIVATE_ENDPOINT,
        )
        return ResponsesCreate(
            conversation=conversation,
            options=options,
            stream=parsed.stream,
            request=parsed,
            parent=parent,
            response_id=response_id,
            session_key=session_key,
            history_bytes=history_bytes,
            requested_reasoning_effort=parsed.echo["reasoning"]["effort"],
            # A stored chain without a prompt_cache_key is keyed by its root, as its engine session.
            routing_key=parsed.echo.get("prompt_cache_key") or session_key,
        )

    def wire(self, parsed: ResponsesCreate, generation: Generation, request_id: str) -> ResponsesWire:
        return ResponsesWire(generation.serving.response_store, parsed, generation)

    def parse_count(self, body: object, serving: ServedModel) -> Conversation:
        parsed = parse_input_tokens(body, serving.request_context)
        return _conversation(serving, parsed)[1]

    def count_body(self, num_tokens: int) -> dict[str, Any]:
        return {"object": "response.input_tokens", "input_tokens": num_tokens}

    def map_error(self, error: APIError) -> APIError:
        error.param = _PARAM_NAMES.get(error.param or "", error.param)
        return error


class ResponsesWire(Wire):
    """One admitted create: folds the generation into Items and stores the terminal Response."""

    def __init__(self, store: ResponseStore, create: ResponsesCreate, generation: Generation):
        self.store = store
        self.create = create
        self.parsed = create.request
        self.generation = generation
        self.failure: APIError | None = None
        self.terminal: dict[str, Any] | None = None
        sampling = generation.sampling
        config = {**self.parsed.echo, "temperature": sampling.temperature, "top_p": sampling.top_p}
        self.assembler = ResponseAssembler(
            create.response_id, config, self.parsed.functions, self.parsed.include_encrypted_reasoning,
            generation.take_logprobs if generation.logprobs is not None else None,
        )

    def begin(self) -> list[bytes]:
        return _frames(self.assembler.begin())

    def output(self, event: object) -> list[bytes]:
        return _frames(self.assembler.feed(event))

    def finish(self, event: FinishEvent) -> list[bytes]:
        """Close the output, store it when asked, and end with exactly one terminal event."""
        if event.reason is FinishReason.CANCELLED:
            # The engine cancelled it while the client still listens: a terminal status, not a failure.
            events = self.assembler.cancel()
            response = self.assembler.snapshot("cancelled", self._usage())
        elif event.reason in (FinishReason.STOP, FinishReason.LENGTH):
            incomplete = event.reason is FinishReason.LENGTH
            events = self.assembler.finish_output(incomplete, self.generation.decoder.reasoning_open)
            response = self.assembler.snapshot("incomplete" if incomplete else "completed", self._usage())
        else:
            self.failure = APIError(
                500, f"generation ended without a result ({event.reason.value})", code="server_error"
            )
            return _frames(self.assembler.fail(self.failure, self._usage()))
        try:
            self._save(response)
        except StoreCapacityExceeded as exc:
            self.failure = _capacity_error(str(exc))
            response = self.assembler.snapshot("failed", self._usage(), self.failure)
        self.terminal = response
        return _frames([*events, self.assembler.terminal(response)])

    def error(self, error: APIError) -> list[bytes]:
        return _frames(self.assembler.fail(error, self._usage()))

    def body(self) -> dict[str, Any]:
        if self.failure is not None:
            raise self.failure  # no stream has started: the failure is an ordinary HTTP error
        assert self.terminal is not None
        return self.terminal

    def _usage(self) -> dict[str, Any]:
        usage = self.generation.usage
        return {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.total_tokens,
        }

    def _save(self, response: dict[str, Any]) -> None:
        if not self.parsed.store:
            return
        parent = self.create.parent
        output = self.assembler.output
        history = [*(parent.history if parent else []), *self.parsed.items, *output]
        record = StoredResponse(
            response=response,
            input_items=self.parsed.items,
            history=history,
            history_bytes=self.create.history_bytes + sum(json_size(item) for item in output),
            preserve_thinking=self.generation.prepared.preserve_thinking,
            session_key=self.create.session_key,
        )
        self.store.put(record)


def _frames(payloads: list[dict]) -> list[bytes]:
    return [event_frame(payload["type"], payload) for payload in payloads]


def _conversation(serving: ServedModel, parsed: ResponsesRequest) -> tuple[StoredResponse | None, Conversation]:
    """The parent record (if any) and the prompt: its stored chain, then this request (create and
    input_tokens share this path, so their token counts agree)."""
    parent = _parent(serving.response_store, parsed.previous_response_id)
    history = parent.history if parent else []
    conversation = build_conversation(parsed, history, parent.preserve_thinking if parent else None)
    check_template_renders_tools(conversation, serving.capabilities, "tools" if conversation.tools else "input")
    return parent, conversation


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


def _capacity_error(message: str) -> APIError:
    return APIError(400, message, code="response_store_capacity_exceeded", param="store")


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response with id {response_id!r}", code="response_not_found")


def _stored(store: ResponseStore, response_id: str) -> StoredResponse:
    record = store.get(response_id)
    if record is None:
        raise _not_found(response_id)
    return record


def _reject_include(request: Request) -> None:
    query = request.query_params
    include = [value for key in ("include", "include[]") for value in query.getlist(key) if value]
    if include:
        raise unsupported("include", f"NInfer cannot provide additional output data ({', '.join(include)})")


def register(app: FastAPI, serving: ServedModel) -> None:
    protocol = ResponsesProtocol()
    store = serving.response_store

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        return await endpoint.generate(request, serving, protocol)

    @app.post("/v1/responses/input_tokens")
    async def input_tokens(request: Request) -> Response:
        return await endpoint.count_tokens(request, serving, protocol)

    @app.post("/v1/responses/compact")
    async def compact(request: Request) -> Response:
        raise APIError(
            400,
            "NInfer cannot compact conversations; keep the history or summarise it client-side",
            code="compaction_not_supported",
        )

    @app.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> Response:
        query = request.query_params
        if query.get("stream", "false").lower() not in ("false", "0"):
            raise unsupported("stream", "NInfer cannot provide stream recovery of a finished response")
        if query.get("starting_after") is not None:
            raise unsupported("starting_after", "NInfer cannot provide stream recovery of a finished response")
        _reject_include(request)
        return JSONResponse(_stored(store, response_id).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> Response:
        if not store.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str) -> Response:
        query = request.query_params
        _reject_include(request)
        limit_text = query.get("limit", str(DEFAULT_LIST_LIMIT))
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_LIST_LIMIT:
            raise invalid("limit", f"limit must be an integer between 1 and {MAX_LIST_LIMIT}, got {limit_text!r}")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("order", f"order must be asc or desc, got {order!r}")
        items = list(_stored(store, response_id).input_items)
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

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(request: Request, response_id: str) -> Response:
        _stored(store, response_id)
        raise APIError(
            400,
            "only background responses can be cancelled, and NInfer does not run responses in the background",
            code="background_not_supported",
        )
