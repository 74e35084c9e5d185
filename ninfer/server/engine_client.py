"""EngineClient: the API process's asyncio handle on the engine.

Two transports behind one interface: the engine in its own OS process (ZMQ + msgpack;
production) or in a thread of this process (tests, `ninfer chat`). The client also owns
the bounded-waiting rules: at most max_concurrency + max_pending_requests requests may
exist from the start of preparation until their response is released (else
Overloaded), and each carries a deadline set before preparation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import queue
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ninfer.config import EngineConfig
from ninfer.contract.messages import (
    Abort,
    AddRequest,
    Failed,
    FromEngine,
    Outputs,
    Ready,
    Shutdown,
    ToEngine,
    decode_from_engine,
    encode,
)
from ninfer.contract.output import EngineError, EngineOutput, ErrorCode, FinishReason
from ninfer.contract.request import EngineRequest
from ninfer.engine.process import engine_process_main

log = logging.getLogger("ninfer.engine")


class Overloaded(RuntimeError):
    """Every admission and waiting place is taken (HTTP 429 server_overloaded)."""


class EngineUnavailable(RuntimeError):
    """The engine failed or stopped (HTTP 503)."""


@dataclass
class Ticket:
    """One request's place in the bounded waiting room, from preparation to release."""

    deadline: float  # time.monotonic()
    _client: EngineClient | None = None

    def release(self) -> None:
        if self._client is not None:
            self._client._release_ticket()
            self._client = None

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class EngineClient:
    def __init__(self, config: EngineConfig):
        self.config = config
        self._streams: dict[str, asyncio.Queue[EngineOutput]] = {}
        self._outstanding = 0
        self._lock = threading.Lock()
        self.failure: str | None = None

    # ---- bounded waiting -----------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.max_concurrency + self.config.max_pending_requests

    @property
    def num_outstanding(self) -> int:
        """Requests holding a place, from preparation until their response is released."""
        return self._outstanding

    def reserve(self) -> Ticket:
        with self._lock:
            if self._outstanding >= self.capacity:
                raise Overloaded(f"{self._outstanding} requests in flight; capacity is {self.capacity}")
            self._outstanding += 1
        return Ticket(time.monotonic() + self.config.pending_timeout_ms / 1000.0, self)

    def _release_ticket(self) -> None:
        with self._lock:
            self._outstanding -= 1

    @property
    def healthy(self) -> bool:
        return self.failure is None

    # ---- generation ----------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream a request's outputs; leaving early (disconnect, cancel) aborts it in the engine."""
        if self.failure is not None:
            raise EngineUnavailable(self.failure)
        stream: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._streams[request.request_id] = stream
        finished = False
        try:
            self._send(AddRequest(request))
            while True:
                out = await stream.get()
                if out.finished:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished and self.failure is None:
                with contextlib.suppress(EngineUnavailable):
                    self._send(Abort(request.request_id))

    def _dispatch(self, message: FromEngine) -> None:
        """Runs on the event loop thread."""
        if isinstance(message, Outputs):
            for out in message.outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(out)
        elif isinstance(message, Failed):
            self._fail_all(message.message)

    def _fail_all(self, message: str) -> None:
        """Engine-wide failure: /health turns 503 and no open stream is left hanging."""
        if self.failure is None:
            log.error("engine failed: %s", message)
        self.failure = message
        for request_id, stream in list(self._streams.items()):
            stream.put_nowait(
                EngineOutput(
                    request_id=request_id,
                    finish_reason=FinishReason.ERROR,
                    error=EngineError(ErrorCode.ENGINE_FAILURE, "the engine failed; see the server log"),
                )
            )

    def _send(self, message: ToEngine) -> None:  # pragma: no cover - transport specific
        raise NotImplementedError

    async def start(self) -> None:  # pragma: no cover - transport specific
        raise NotImplementedError

    async def shutdown(self) -> None:  # pragma: no cover - transport specific
        raise NotImplementedError


class InProcessEngineClient(EngineClient):
    """The engine loop in a daemon thread of this process."""

    def __init__(self, config: EngineConfig, build_core: Callable[[], object]):
        super().__init__(config)
        self._build_core = build_core
        self._inbox: queue.Queue[ToEngine] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.core = None

    async def start(self) -> None:
        from ninfer.engine.loop import EngineLoop

        loop = asyncio.get_running_loop()
        self.core = self._build_core()

        def receive(timeout: float | None) -> ToEngine | None:
            try:
                return self._inbox.get(timeout=timeout) if timeout != 0.0 else self._inbox.get_nowait()
            except queue.Empty:
                return None

        def publish(message: FromEngine) -> None:
            loop.call_soon_threadsafe(self._dispatch, message)

        engine_loop = EngineLoop(self.core, receive, publish)
        self._thread = threading.Thread(target=engine_loop.run, name="ninfer-engine", daemon=True)
        self._thread.start()

    def _send(self, message: ToEngine) -> None:
        self._inbox.put(message)

    async def shutdown(self) -> None:
        if self._thread is not None:
            self._inbox.put(Shutdown())
            await asyncio.to_thread(self._thread.join, 10)
            self._thread = None


class ProcessEngineClient(EngineClient):
    """The engine in its own OS process, so JSON/SSE work never delays a decode batch."""

    def __init__(
        self,
        config: EngineConfig,
        build_core: Callable[[], object],
        start_timeout_s: float = 3600.0,
        log_level: str = "info",
    ):
        super().__init__(config)
        self._build_core = build_core
        self._log_level = log_level
        self._start_timeout_s = start_timeout_s
        self._process: multiprocessing.process.BaseProcess | None = None
        self._reader: asyncio.Task | None = None

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        socket_dir = tempfile.mkdtemp(prefix="ninfer-")
        tag = uuid.uuid4().hex[:8]
        inbox_addr = f"ipc://{socket_dir}/in-{tag}"
        outbox_addr = f"ipc://{socket_dir}/out-{tag}"
        # Sends are small and non-blocking: a plain socket; receives are awaited on the event loop.
        self._sync_context = zmq.Context()
        self._push = self._sync_context.socket(zmq.PUSH)
        self._push.bind(inbox_addr)
        self._context = zmq.asyncio.Context()
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(outbox_addr)
        spawn = multiprocessing.get_context("spawn")
        self._process = spawn.Process(
            target=engine_process_main, args=(self._build_core, inbox_addr, outbox_addr, self._log_level),
            name="ninfer-engine",

        )
        self._process.start()
        first = decode_from_engine(await asyncio.wait_for(self._pull.recv(), self._start_timeout_s))
        if isinstance(first, Failed):
            self.failure = first.message
            raise EngineUnavailable(first.message)
        if not isinstance(first, Ready):  # the engine sends Ready once its model is loaded
            raise EngineUnavailable(f"unexpected first message from the engine process: {type(first).__name__}")
        self._reader = asyncio.create_task(self._read_outputs())

    async def _read_outputs(self) -> None:
        import zmq

        while True:
            try:
                if not await self._pull.poll(1000, zmq.POLLIN):
                    if self._process is not None and not self._process.is_alive():
                        self._fail_all(f"engine process exited with code {self._process.exitcode}")
                        return
                    continue
                data = await self._pull.recv()
            except asyncio.CancelledError:
                return
            self._dispatch(decode_from_engine(data))

    def _send(self, message: ToEngine) -> None:
        """Never blocks the event loop: a PUSH socket whose peer is gone (the engine process died
        or was killed) would wait forever for one to connect."""
        import zmq

        try:
            self._push.send(encode(message), flags=zmq.NOBLOCK)
        except zmq.Again as error:
            raise EngineUnavailable("the engine process is not receiving requests") from error

    async def shutdown(self) -> None:
        if self._process is None:
            return
        with contextlib.suppress(Exception):
            self._send(Shutdown())
        await asyncio.to_thread(self._process.join, 10)
        if self._process.is_alive():
            self._process.kill()
        if self._reader is not None:
            self._reader.cancel()
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._context.term()
        self._sync_context.term()
        self._process = None
