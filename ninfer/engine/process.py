"""The engine process's main function: build the core, then serve the loop over ZMQ.

The API process spawns it by name (server/engine_client.py), so the API process never imports
the engine or torch, and talks to it with the messages of contract/messages.py. A start the
start-up checks refuse is reported as Refused, any other start-up failure as Failed, before
the process exits.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable

from ninfer.artifact.artifact import ArtifactError
from ninfer.config import ConfigValueError
from ninfer.contract.messages import Failed, FromEngine, Ready, Refused, ToEngine, decode_to_engine, encode
from ninfer.engine.background_imports import wait_for_background_imports

log = logging.getLogger("ninfer.engine")

# perf_counter when this process's main began: the builder reports how long its imports took.
main_entered_at: float | None = None


def engine_process_main(
    build_core: Callable[[], object], inbox_addr: str, outbox_addr: str, log_level: str = "info"
) -> None:
    """Entry point of the engine process: build the core, then serve the loop over ZMQ."""
    global main_entered_at
    main_entered_at = time.perf_counter()
    import zmq

    die_with_parent()
    # The terminal's Ctrl-C reaches the whole process group; the API process decides the shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ninfer.log import setup_logging

    # A spawned process starts with bare logging; the API process configured its own.
    setup_logging(log_level)
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.connect(inbox_addr)
    push = context.socket(zmq.PUSH)
    push.connect(outbox_addr)
    try:
        _serve(build_core, context, push, pull)
    finally:
        wait_for_background_imports()


def _serve(build_core, context, push, pull) -> None:
    """Build the core and run the loop until told to stop; every path closes the sockets."""
    import zmq

    from ninfer.engine.loop import EngineLoop

    try:
        core = build_core()
    except (ConfigValueError, ArtifactError) as exc:
        # The user's to fix, not a crash: no traceback here; the API process prints the one line.
        _close(context, push, pull, Refused(str(exc), artifact=isinstance(exc, ArtifactError)))
        return
    except Exception as exc:  # noqa: BLE001 - reported to the API process, which exits
        log.exception("engine start-up failed")
        _close(context, push, pull, Failed(f"start-up failed: {type(exc).__name__}: {exc}"))
        return
    push.send(encode(Ready({"pid": os.getpid(), **core.describe()})))

    def receive(timeout: float | None) -> ToEngine | None:
        if timeout is None:
            return decode_to_engine(pull.recv())
        if timeout == 0.0:
            try:
                return decode_to_engine(pull.recv(flags=zmq.NOBLOCK))
            except zmq.Again:
                return None
        if pull.poll(int(timeout * 1000)):
            return decode_to_engine(pull.recv())
        return None

    EngineLoop(core, receive, lambda m: push.send(encode(m))).run()
    _close(context, push, pull)


def _close(context, push, pull, last: FromEngine | None = None) -> None:
    """Send the last message, if any, and give it a second to leave before the sockets close."""
    if last is not None:
        push.send(encode(last))
    push.close(linger=1000)
    pull.close(linger=0)
    context.term()


def die_with_parent() -> None:
    """On Linux the kernel sends this process SIGTERM when the API process exits (for a
    tensor-parallel follower: when rank 0's thread that spawned it ends), however it exits (a
    crash or SIGKILL included), so the engine never outlives it holding the GPU."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)  # the parent is already gone: the signal was set too late to fire

