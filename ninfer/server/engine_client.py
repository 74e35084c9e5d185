"""EngineClient: the API process's asyncio handle on the engine.

Two transports behind one interface: the engine in its own OS process (ZMQ + msgpack;
production) or in a thread of this process (tests, `ninfer chat`). The engine's modules are
imported by name where the engine runs (call_by_name), so the API process imports neither the
engine nor torch unless the engine runs in one of its threads. The client also owns
the bounded-waiting rules: at most max_concurrency + max_pending_requests requests may
exist from the start of preparation until their response is released (else
Overloaded), and each carries a deadline set before preparation.

When the engine fails engine-wide (it reports Failed, or its process dies) the client ends
every open stream, stops that engine and starts a fresh one from the same builder, at most
MAX_RESTARTS times in any RESTART_WINDOW_S; meanwhile /health is 503 with the reason and new
requests are refused with EngineUnavailable.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
import logging
import math
import multiprocessing
import queue
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec

from ninfer.artifact.artifact import ArtifactError
from ninfer.config import ConfigValueError, EngineConfig
from ninfer.contract.messages import (
    Abort,
    AddRequest,
    Failed,
    FromEngine,
    Gauges,
    Outputs,
    Ready,
    Refused,
    Shutdown,
    Stats,
    ToEngine,
    decode_from_engine,
    encode,
)
from ninfer.contract.output import EngineError, EngineOutput, ErrorCode, FinishReason
from ninfer.contract.request import EngineRequest

log = logging.getLogger("ninfer.engine")

# The engine process's main function, imported by name in the spawned process.
ENGINE_PROCESS_MAIN = "ninfer.engine.process:engine_process_main"

# A fault that recurs more often than MAX_RESTARTS times in RESTART_WINDOW_S is not transient:
# the engine then stays failed until the server itself is restarted.
MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0
# How long a stopping engine may take to leave after Shutdown before it is killed (process) or
# abandoned (thread, a daemon).
ENGINE_STOP_TIMEOUT_S = 10.0

RESTARTING_NOTICE = "the engine failed and is restarting; retry the request"
FAILED_NOTICE = "the engine failed and was not restarted; see the server log"


def call_by_name(target: str, *args: object) -> object:
    """Import "module:function" and call it with args: importing only here keeps the engine's modules
    (and torch) out of the API process, and a partial of this function pickles by name into a spawn."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)(*args)


class Overloaded(RuntimeError):
    """Every admission and waiting place is taken (HTTP 429 server_overloaded)."""


class EngineUnavailable(RuntimeError):
    """The engine failed, is restarting or stopped (HTTP 503)."""

    def __init__(self, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s  # when the engine should serve again, if known


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
    """The transport-independent part: streams, bounded waiting, start, failure and restart.

    A transport implements _start_engine (start an engine that reports Ready or a start-up
    failure) and _stop_engine (stop it, idempotent and bounded in time), and hands what the
    engine says to _dispatch / _engine_down on the event loop thread."""

    def __init__(self, config: EngineConfig, build_core: Callable[[], object], start_timeout_s: float = 3600.0):
        self.config = config
        self._build_core = build_core
        self._start_timeout_s = start_timeout_s
        self._streams: dict[str, asyncio.Queue[EngineOutput]] = {}
        self._outstanding = 0
        self._lock = threading.Lock()
        self.failure: str | None = None  # why the engine is not serving (restarting or failed for good)
        self.engine_info: dict = {}  # what the engine reported when it became ready (capacities, device)
        self.on_stats: Callable[[dict], None] | None = None  # throughput records, on the event loop thread
        self.on_gauges: Callable[[dict], None] | None = None  # pool occupancy when the engine turns idle, likewise
        self._ready: asyncio.Future[None] | None = None  # set while an engine starts; done at Ready or failure
        self._start_error: Exception | None = None  # why the start in progress failed
        self._engine_ready = False  # the current engine reached Ready, so it can be stopped gracefully
        self._restart_task: asyncio.Task | None = None
        self._restarted_at: collections.deque[float] = collections.deque()  # attempts within the window
        self._attempt_began = 0.0
        self._last_start_s = 0.0  # how long the last successful start took: the restart estimate
        self._stopping = False

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

    @property
    def restarting(self) -> bool:
        return self._restart_task is not None

    # ---- generation ----------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream a request's outputs; leaving early (disconnect, cancel) aborts it in the engine."""
        if self.failure is not None:
            if self.restarting:
                raise EngineUnavailable(RESTARTING_NOTICE, self._restart_eta_s())
            raise EngineUnavailable(FAILED_NOTICE)
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

    def _restart_eta_s(self) -> int:
        """Seconds until the restart should be done, judged by how long the last start took."""
        return max(1, math.ceil(self._last_start_s - (time.monotonic() - self._attempt_began)))

    def _dispatch(self, message: FromEngine) -> None:
        """Runs on the event loop thread."""
        if isinstance(message, Outputs):
            for out in message.outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(self._with_failure_notice(out))
        elif isinstance(message, Ready):
            self.engine_info = dict(message.info)
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
        elif isinstance(message, Failed):
            self._engine_down(message.message)
        elif isinstance(message, Refused):
            if self._ready is None:  # no start in progress: nothing to refuse, the engine is just gone
                self._engine_down(message.message)
            else:
                # Raised by the start as the check itself would raise it: the command line prints it (exit 2).
                self._start_failed(ArtifactError(message.message) if message.artifact
                                   else ConfigValueError(message.message))
        elif isinstance(message, Stats) and self.on_stats is not None:
            self.on_stats(message.record)
        elif isinstance(message, Gauges) and self.on_gauges is not None:
            self.on_gauges(message.record)

    def _with_failure_notice(self, out: EngineOutput) -> EngineOutput:
        """The engine ends its own requests on an engine-wide failure just before it reports
        Failed; their clients are told what the client does about it, as every other stream is."""
        if out.error is None or out.error.code is not ErrorCode.ENGINE_FAILURE:
            return out
        notice = RESTARTING_NOTICE if self._restarts_left() > 0 else FAILED_NOTICE
        return msgspec.structs.replace(out, error=msgspec.structs.replace(out.error, message=notice))

    # ---- start, failure, restart, shutdown -----------------------------------------
    async def start(self) -> None:
        """The server's first start: a failure here aborts start-up and is never restarted."""
        try:
            await self._launch()
        except Exception as error:
            self.failure = str(error) or type(error).__name__
            raise

    async def _launch(self) -> None:
        """Start an engine and wait until it is Ready; on failure the engine is stopped again."""
        began = time.monotonic()
        self._ready = asyncio.get_running_loop().create_future()
        self._start_error = None
        self._engine_ready = False
        try:
            await self._start_engine()
            try:
                await asyncio.wait_for(self._ready, self._start_timeout_s)
            except asyncio.TimeoutError as error:
                raise EngineUnavailable(f"the engine was not ready within {self._start_timeout_s:g} s") from error
            if self._start_error is not None:
                raise self._start_error
        except Exception:
            await self._stop_engine()
            raise
        finally:
            self._ready = None
        self._engine_ready = True
        self._last_start_s = time.monotonic() - began

    def _start_failed(self, error: Exception) -> None:
        """The start in progress fails with its first error, even one that comes after Ready but
        before _launch has seen it."""
        if self._start_error is None:
            self._start_error = error
        if not self._ready.done():
            self._ready.set_result(None)

    def _engine_down(self, cause: str) -> None:
        """The engine reported Failed or stopped running: a start in progress fails, a serving engine
        is restarted. Our own shutdown and a restart already under way are no new failure."""
        if self._stopping:
            return
        if self._ready is not None:
            self._start_failed(EngineUnavailable(cause))
        elif self.failure is None:
            self._engine_failed(cause)

    def _engine_failed(self, cause: str) -> None:
        if self._next_attempt(f"engine failed: {cause}"):
            self._restart_task = asyncio.create_task(self._restart())
        notice = RESTARTING_NOTICE if self.restarting else FAILED_NOTICE
        for request_id, stream in self._streams.items():
            stream.put_nowait(
                EngineOutput(
                    request_id=request_id,
                    finish_reason=FinishReason.ERROR,
                    error=EngineError(ErrorCode.ENGINE_FAILURE, notice),
                )
            )
        self._streams.clear()  # nothing the old engine still sends may follow a stream's last output

    def _restarts_left(self) -> int:
        now = time.monotonic()
        while self._restarted_at and now - self._restarted_at[0] >= RESTART_WINDOW_S:
            self._restarted_at.popleft()
        return MAX_RESTARTS - len(self._restarted_at)

    def _next_attempt(self, what_failed: str) -> bool:
        """Record the failure (the reason /health gives) and count a restart attempt; False when the
        window's restarts are spent and the engine stays failed."""
        if self._restarts_left() <= 0:
            self.failure = (
                f"{what_failed}; not restarting: {MAX_RESTARTS} restarts within "
                f"{RESTART_WINDOW_S / 60:g} minutes; restart the server"
            )
            log.error("%s", self.failure)
            return False
        self._attempt_began = time.monotonic()
        self._restarted_at.append(self._attempt_began)
        self.failure = f"{what_failed}; restarting (attempt {len(self._restarted_at)} of {MAX_RESTARTS})"
        log.error("%s", self.failure)
        return True

    async def _restart(self) -> None:
        """Replace the failed engine with a fresh one; a restart that fails counts as an attempt."""
        try:
            while True:
                try:
                    await self._stop_engine()
                    await self._launch()
                except Exception as error:  # noqa: BLE001 - whatever stops a restart is the next cause
                    if not self._next_attempt(f"engine restart failed: {str(error) or type(error).__name__}"):
                        return
                    continue
                log.info("engine restarted in %.1f s", time.monotonic() - self._attempt_began)
                self.failure = None
                return
        finally:
            self._restart_task = None

    async def shutdown(self) -> None:
        """Stop the engine for good; a restart under way is abandoned, not waited for."""
        self._stopping = True
        if self._restart_task is not None:
            self._restart_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restart_task
        await self._stop_engine()

    # ---- transport -----------------------------------------------------------------
    def _send(self, message: ToEngine) -> None:  # pragma: no cover - transport specific
        raise NotImplementedError

    async def _start_engine(self) -> None:  # pragma: no cover - transport specific
        raise NotImplementedError

    async def _stop_engine(self) -> None:  # pragma: no cover - transport specific
        raise NotImplementedError


class InProcessEngineClient(EngineClient):
    """The engine loop in a daemon thread of this process; the thread builds the core itself, as
    the engine process does, so a slow build never blocks the event loop."""

    def __init__(self, config: EngineConfig, build_core: Callable[[], object], start_timeout_s: float = 3600.0):
        super().__init__(config, build_core, start_timeout_s)
        self._inbox: queue.Queue[ToEngine] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._generation = 0  # which thread may speak: one that did not stop in time is ignored
        self.core = None

    async def _start_engine(self) -> None:
        self._generation += 1
        self._inbox = queue.Queue()
        self._thread = threading.Thread(
            target=self._run_engine,
            args=(asyncio.get_running_loop(), self._generation, self._inbox),
            name="ninfer-engine",
            daemon=True,
        )
        self._thread.start()

    def _run_engine(self, loop: asyncio.AbstractEventLoop, generation: int, inbox: queue.Queue[ToEngine]) -> None:
        from ninfer.engine.loop import EngineLoop

        def call_soon(callback: Callable, *args: object) -> None:
            # A thread left building at shutdown may outlive the event loop: then nobody listens.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(callback, generation, *args)

        def publish(message: FromEngine) -> None:
            call_soon(self._on_message, message)

        try:
            core = self._build_core()
        except Exception as error:  # noqa: BLE001 - raised by the start, as a direct build_core() call would
            call_soon(self._on_build_failed, error)
            return
        call_soon(self._on_built, core)

        def receive(timeout: float | None) -> ToEngine | None:
            try:
                return inbox.get(timeout=timeout) if timeout != 0.0 else inbox.get_nowait()
            except queue.Empty:
                return None

        try:
            EngineLoop(core, receive, publish).run()
        except Exception as error:  # noqa: BLE001 - the thread's equivalent of the engine process dying
            log.exception("the engine loop crashed")
            publish(Failed(f"the engine loop crashed: {type(error).__name__}: {error}"))

    def _on_message(self, generation: int, message: FromEngine) -> None:
        if generation == self._generation:
            self._dispatch(message)

    def _on_build_failed(self, generation: int, error: Exception) -> None:
        if generation == self._generation and self._ready is not None:
            self._start_failed(error)

    def _on_built(self, generation: int, core: object) -> None:
        if generation == self._generation:
            self.core = core
            describe = getattr(core, "describe", None)
            self._dispatch(Ready(describe() if describe is not None else {}))

    def _send(self, message: ToEngine) -> None:
        self._inbox.put(message)

    async def _stop_engine(self) -> None:
        """A thread cannot be killed: one still building its core is left to end on its own (it
        reads the Shutdown once built), and whatever it says from now on is ignored."""
        if self._thread is None:
            return
        self._generation += 1
        self._inbox.put(Shutdown())
        if self._engine_ready:
            await asyncio.to_thread(self._thread.join, ENGINE_STOP_TIMEOUT_S)
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
        super().__init__(config, build_core, start_timeout_s)
        self._log_level = log_level
        self._process: multiprocessing.process.BaseProcess | None = None
        self._reader: asyncio.Task | None = None
        self._exiting = False  # the process reported a failed start and leaves on its own

    async def _start_engine(self) -> None:
        import zmq
        import zmq.asyncio

        self._exiting = False
        self._socket_dir = tempfile.mkdtemp(prefix="ninfer-")
        inbox_addr = f"ipc://{self._socket_dir}/in"
        outbox_addr = f"ipc://{self._socket_dir}/out"
        # Sends are small and non-blocking: a plain socket; receives are awaited on the event loop.
        self._sync_context = zmq.Context()
        self._push = self._sync_context.socket(zmq.PUSH)
        self._push.bind(inbox_addr)
        self._context = zmq.asyncio.Context()
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(outbox_addr)
        spawn = multiprocessing.get_context("spawn")
        self._process = spawn.Process(
            target=call_by_name,
            args=(ENGINE_PROCESS_MAIN, self._build_core, inbox_addr, outbox_addr, self._log_level),
            name="ninfer-engine",
        )
        self._process.start()
        # Reading starts before Ready, so a process that dies while loading fails the start at once.
        self._reader = asyncio.create_task(self._read_outputs(self._pull, self._process))

    async def _read_outputs(self, pull, process: multiprocessing.process.BaseProcess) -> None:
        import zmq

        while True:
            try:
                if not await pull.poll(1000, zmq.POLLIN):
                    if not process.is_alive():
                        self._engine_down(f"the engine process {_describe_exit(process.exitcode)}")
                        return
                    continue
                data = await pull.recv()
            except asyncio.CancelledError:
                return
            self._dispatch(decode_from_engine(data))

    def _dispatch(self, message: FromEngine) -> None:
        if isinstance(message, (Failed, Refused)) and not self._engine_ready:
            self._exiting = True
        super()._dispatch(message)

    def _send(self, message: ToEngine) -> None:
        """Never blocks the event loop: a PUSH socket whose peer is gone (the engine process died
        or was killed) would wait forever for one to connect."""
        import zmq

        try:
            self._push.send(encode(message), flags=zmq.NOBLOCK)
        except zmq.Again as error:
            raise EngineUnavailable("the engine process is not receiving requests") from error

    async def _stop_engine(self) -> None:
        """Shutdown and a bounded wait (none for a process still loading, unless it reported a failed
        start and is leaving), then SIGKILL; it returns once the process is gone, so its device
        memory is free for the next one. Cancelled half-way, a second call finishes the job."""
        if self._process is None:
            return
        self._reader.cancel()  # the process leaving now is no failure to report
        if self._engine_ready:
            with contextlib.suppress(Exception):
                self._send(Shutdown())
        if self._engine_ready or self._exiting:
            # Left to exit, a process releases what it holds (the device, named semaphores); one killed
            # mid-exit leaves its semaphores for the resource tracker to complain about at shutdown.
            await asyncio.to_thread(self._process.join, ENGINE_STOP_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            await asyncio.to_thread(self._process.join, ENGINE_STOP_TIMEOUT_S)
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._context.term()
        self._sync_context.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)
        self._process = None


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"
