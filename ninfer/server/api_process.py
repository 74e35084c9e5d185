"""The API process's main: bind the port, start the engine, open the artifact, serve with uvicorn.

The API process reads the artifact's metadata only (tokenizer, template, config) and imports
neither torch nor the engine: the engine process is started by name, opens the weights and runs
the start-up checks that need the model (device, KV formats, speculative backend). A start it
refuses ends this process with the check's message, exactly as a bad option does.

A start that takes longer than GRAMMAR_PRELOAD_AFTER_S (a GPU model's load, graph capture and
warm-up) is used to import the grammar library on a worker thread, so the first structured
request does not wait for it (it brings torch and transformers: seconds); a quicker start never
imports it before a request needs it.

Shutdown: SIGTERM or SIGINT stops accepting, lets in-flight requests finish for up to
SHUTDOWN_GRACE_S, then stops the engine process and exits 0; a second SIGINT cuts the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import sys
import threading
import time

import uvicorn

from ninfer.artifact import ArtifactError, open_artifact
from ninfer.artifact.default_model import default_model_path, open_default_model
from ninfer.config import EngineSpec, ServeConfig
from ninfer.frontend.grammar_library import grammar_library
from ninfer.log import setup_logging
from ninfer.server.engine_client import EngineClient, InProcessEngineClient, ProcessEngineClient, call_by_name
from ninfer.server.http_app import create_app
from ninfer.server.http_protocol import GuardedHttpProtocol
from ninfer.server.request_log import open_request_log
from ninfer.server.served_model import ServedModel

log = logging.getLogger("ninfer.server")

# A dead or silent peer is dropped within ~20 s together with the 5 s SSE heartbeat.
TCP_USER_TIMEOUT_MS = 15_000
TCP_KEEPALIVE_IDLE_S = 5
TCP_KEEPALIVE_INTERVAL_S = 5
TCP_KEEPALIVE_PROBES = 2
SHUTDOWN_GRACE_S = 30  # how long a stop signal lets in-flight requests finish
KEEP_ALIVE_S = 30  # an idle kept-alive connection is closed after this long
# What builds the engine core from an EngineSpec, imported by name where the engine runs.
BUILD_ENGINE_CORE = "ninfer.engine.builder:build_engine_core"
# An engine start still under way after this long hides the grammar library's import.
GRAMMAR_PRELOAD_AFTER_S = 10.0


class ListenError(RuntimeError):
    """The port cannot be bound; raised before the model loads."""


class _Server(uvicorn.Server):
    """uvicorn's server, except that a stop signal ends serve() normally: uvicorn re-raises the
    signal after its shutdown, which would kill this process before it stops the engine process."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening socket whose accepted connections inherit keepalive and TCP_USER_TIMEOUT (Linux)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if sys.platform.startswith("linux"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, TCP_KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, TCP_KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, TCP_KEEPALIVE_PROBES)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS)
    sock.bind(address)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def build_serving(config: ServeConfig, kv_capacity_auto: bool = False) -> ServedModel:
    """Open the artifact's metadata on the API side (tokenizer and template, no weights) and the engine
    client; the engine opens the weights and checks what needs the model when it starts."""
    client, artifact_path = engine_client(config, kv_capacity_auto)
    return served_model(config, artifact_path, client)


def engine_client(config: ServeConfig, kv_capacity_auto: bool = False) -> tuple[EngineClient, str]:
    """-> (the engine client, not started; the artifact's path): nothing of the artifact is read."""
    artifact_path = str(default_model_path()) if config.artifact is None else config.artifact
    spec = EngineSpec(
        artifact_path=artifact_path,
        engine=config.engine,
        dtype=config.dtype,
        quantize=config.quantize,
        kv_capacity_auto=kv_capacity_auto,
        device_index=config.device_index,
    )
    build = functools.partial(call_by_name, BUILD_ENGINE_CORE, spec)
    if config.engine_process:
        return ProcessEngineClient(config.engine, build, log_level=config.log_level), artifact_path
    return InProcessEngineClient(config.engine, build), artifact_path


def served_model(config: ServeConfig, artifact_path: str, client: EngineClient) -> ServedModel:
    """The artifact's metadata opened (tokenizer and template, no weights) around `client`."""
    if config.artifact is None:
        artifact = open_default_model(weights=False)  # with the model card's sampling defaults
    else:
        artifact = open_artifact(artifact_path, weights=False)
    if config.engine.vision and not artifact.hf_config.get("vision_config"):
        raise ArtifactError(f"--vision: {artifact_path} has no vision tower (its config has no vision_config)")
    observers = []
    if config.request_log_jsonl is not None:
        # Before the model loads: a bad path fails start-up at once.
        observers.append(open_request_log(config.request_log_jsonl, artifact_path))
    serving = ServedModel.create(config, artifact, client)
    serving.events.observers.extend(observers)
    client.on_stats = lambda record: serving.events.emit("throughput", record)
    client.on_gauges = serving.events.gauges
    return serving


def serve(config: ServeConfig, kv_capacity_auto: bool = False) -> None:
    setup_logging(config.log_level)
    started = time.perf_counter()
    try:
        # Before the model loads: a busy port fails in a moment, not after minutes of loading.
        sock = listen_socket(config.host, config.port)
    except OSError as error:
        raise ListenError(f"cannot listen on {config.host}:{config.port}: {error.strerror or error}") from error
    try:
        asyncio.run(_run(config, kv_capacity_auto, started, sock))
    finally:
        sock.close()


def _log_served_model(serving: ServedModel) -> None:
    caps = serving.capabilities
    log.info(
        "model %s · template: thinking %s%s%s",
        serving.model_id,
        ("on by default" if caps.thinking_default else "off by default") if caps.supports_thinking else "unsupported",
        f" · effort {'/'.join(caps.effort_tiers)} (default {caps.default_effort})" if caps.effort_tiers else "",
        " · preserve_thinking" if caps.supports_preserve_thinking else "",
    )
    log.info("sampling defaults: %s", serving.sampling_defaults.describe())


def uvicorn_config(app, **overrides) -> uvicorn.Config:
    """The HTTP server's settings: our header guards on uvicorn's HTTP/1.1 protocol, idle
    keep-alive connections closed after 30 s, no logging or lifespan of uvicorn's own."""
    settings = dict(log_config=None, access_log=False, lifespan="off", timeout_keep_alive=KEEP_ALIVE_S,
                    http=GuardedHttpProtocol)
    return uvicorn.Config(app, **{**settings, **overrides})


async def start_engine(client: EngineClient) -> None:
    """Start the engine; while a long start runs, import the grammar library (module docstring)."""
    preload = asyncio.create_task(_import_grammar_library_after(GRAMMAR_PRELOAD_AFTER_S))
    try:
        await client.start()
    finally:
        preload.cancel()  # an import already running on its thread finishes there


async def _import_grammar_library_after(delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    began = time.perf_counter()
    try:
        await asyncio.to_thread(grammar_library)
    except Exception as error:  # noqa: BLE001 - the first structured request reports it, not the start
        log.debug("grammar library not imported during the engine's start: %s", error)
        return
    log.debug("grammar library imported during the engine's start (%.1fs)", time.perf_counter() - began)


async def _run(config: ServeConfig, kv_capacity_auto: bool, started: float, sock: socket.socket) -> None:
    client, artifact_path = engine_client(config, kv_capacity_auto)
    # The engine process starts first (its imports and load take seconds); the artifact's
    # metadata opens here meanwhile. A bad artifact or option found here stops the engine, quietly.
    starting = asyncio.create_task(start_engine(client))
    try:
        serving = await asyncio.to_thread(served_model, config, artifact_path, client)
    except BaseException:
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        await client.shutdown()
        raise
    try:
        await starting
    except BaseException:
        serving.close()
        raise
    # Once the engine is up: a start it refuses prints its one error line and nothing else.
    _log_served_model(serving)
    serving.record_server_start()
    server = _Server(
        uvicorn_config(create_app(serving), timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    )
    host = f"[{config.host}]" if ":" in config.host else config.host
    log.info("ready in %.1fs: http://%s:%d/v1 (max context %d, concurrency %d)", time.perf_counter() - started,
             host, config.port, config.engine.max_context, config.engine.max_concurrency)
    if config.web_ui:
        log.info("chat page: http://%s:%d/", host, config.port)
    try:
        await server.serve(sockets=[sock])
    finally:
        log.info("shutting down")
        await serving.engine.shutdown()
        serving.close()
    log.info("stopped")
