"""The HTTP application: the three protocols' routes, health, models and metrics, the chat page, middleware,
error rendering."""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from ninfer.server.anthropic_messages import routes as messages_routes
from ninfer.server.errors import APIError
from ninfer.server.generation import ClientDisconnected
from ninfer.server.http import error_response, request_id_of
from ninfer.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ninfer.server.metrics import install_metrics
from ninfer.server.middleware import PUBLIC_PATHS, AuthMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from ninfer.server.openai_chat import routes as chat_routes
from ninfer.server.openai_responses import routes as responses_routes
from ninfer.server.openapi import openapi_document
from ninfer.server.served_model import ServedModel
from ninfer.server.web_ui import page as web_ui

log = logging.getLogger("ninfer.server")


def create_app(serving: ServedModel):
    created = int(time.time())
    app = FastAPI(title="NInfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> Response:
        return error_response(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request: Request, error: StarletteHTTPException) -> Response:
        # No route or method: the protocol's envelope too, not FastAPI's {"detail": ...}.
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return error_response(request, APIError(error.status_code, f"{request.method} {request.url.path}: "
                                                f"{error.detail}", code=code))

    @app.exception_handler(ClientDisconnect)  # gone while its body was being read
    @app.exception_handler(ClientDisconnected)
    async def _client_gone(request: Request, error: Exception) -> Response:
        # Nobody reads this response; the request was cancelled in the engine or never started.
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
        return JSONResponse({"status": "unavailable", "reason": serving.engine.failure}, status_code=503)

    openapi = openapi_document(vision=serving.config.engine.vision)

    @app.get("/openapi.json")
    async def openapi_json() -> Response:
        return JSONResponse(openapi)

    metrics = install_metrics(serving)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    def model_card() -> dict:
        return {
            "id": serving.model_id,
            "object": "model",
            "created": created,
            "owned_by": "ninfer",
            "max_model_len": serving.max_model_len,
            "capabilities": serving.model_capabilities,
        }

    @app.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        if model_id != serving.model_id:
            raise APIError(404, f"the model {model_id!r} does not exist", code="model_not_found", param="model")
        return JSONResponse(model_card())

    chat_routes.register(app, serving)
    responses_routes.register(app, serving)
    messages_routes.register(app, serving)

    config = serving.config
    public_paths = PUBLIC_PATHS
    if config.web_ui:
        public_paths += web_ui.register(app)
    wrapped = AuthMiddleware(app, config.api_key, public_paths) if config.api_key else app
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
