"""The HTTP application: routes, middleware stack and error rendering."""

from __future__ import annotations

import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware

from ninfer.server.errors import APIError
from ninfer.server.generation import ClientDisconnected
from ninfer.server.middleware import AuthMiddleware, BodyLimitMiddleware, RequestIdMiddleware, error_body
from ninfer.server.serving import Serving

log = logging.getLogger("ninfer.server")


def request_id_of(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id", "")


def error_response(request: Request, error: APIError) -> Response:
    return Response(
        error_body(request.url.path, error, request_id_of(request)),
        status_code=error.status,
        media_type="application/json",
    )


async def read_json(request: Request) -> object:
    """Parse the body keeping member order (tool schemas and arguments reach the prompt as sent)."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc


def _bind(handler, serving: Serving):
    """Route adapter: handler(request, serving, **path_params) -> Response."""

    async def endpoint(request: Request) -> Response:
        return await handler(request, serving, **request.path_params)

    endpoint.__name__ = handler.__name__
    return endpoint


def create_app(serving: Serving) -> FastAPI:
    from ninfer.server import anthropic_messages, openai_chat, openai_responses

    created = int(time.time())
    app = FastAPI(title="NInfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> Response:
        return error_response(request, error)

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(request: Request, error: ClientDisconnected) -> Response:
        # Nobody reads this response; the request was already cancelled in the engine.
        log.info("request %s: client disconnected", request_id_of(request))
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, error: Exception) -> Response:
        log.exception("internal error on %s", request.url.path)
        return error_response(request, APIError(500, "internal server error", code="internal_error"))

    @app.get("/health")
    async def health() -> Response:
        if serving.engine.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    def model_card() -> dict:
        return {
            "id": serving.model_id,
            "object": "model",
            "created": created,
            "owned_by": "ninfer",
            "max_model_len": serving.max_model_len,
        }

    @app.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        if model_id != serving.model_id:
            raise APIError(404, f"the model {model_id!r} does not exist", code="model_not_found", param="model")
        return JSONResponse(model_card())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai_chat.create(request, serving)

    # OpenAI Responses Core (openai_responses.py)
    app.add_api_route("/v1/responses", _bind(openai_responses.create, serving), methods=["POST"])
    app.add_api_route("/v1/responses/input_tokens", _bind(openai_responses.input_tokens, serving), methods=["POST"])
    app.add_api_route("/v1/responses/compact", _bind(openai_responses.compact, serving), methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", _bind(openai_responses.retrieve, serving), methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", _bind(openai_responses.delete, serving), methods=["DELETE"])
    app.add_api_route(
        "/v1/responses/{response_id}/input_items", _bind(openai_responses.input_items, serving), methods=["GET"]
    )
    app.add_api_route("/v1/responses/{response_id}/cancel", _bind(openai_responses.cancel, serving), methods=["POST"])

    # Anthropic Messages (anthropic_messages.py)
    app.add_api_route("/v1/messages", _bind(anthropic_messages.create, serving), methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", _bind(anthropic_messages.count_tokens, serving), methods=["POST"])

    config = serving.config
    wrapped = AuthMiddleware(app, config.api_key) if config.api_key else app
    wrapped = BodyLimitMiddleware(wrapped, config.max_request_mib << 20)
    wrapped = RequestIdMiddleware(wrapped)
    if config.cors:
        wrapped = CORSMiddleware(
            wrapped,
            allow_origins=["*"],
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["x-request-id", "request-id"],
        )
    return wrapped
