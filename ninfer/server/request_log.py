"""RequestLog: the `--request-log-jsonl FILE` writer, one JSON object per line.

Opened at start-up in append mode (campaigns of several runs share one file); the parent
directory must exist and the path must not resolve into the model artifact. Events go through
a bounded queue to a writer thread that flushes after every line, so a slow disk never delays
the event loop; when the queue is full the event is counted (reported as
`request_log_dropped_events` in the next throughput event), not waited for.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Any

from ninfer.config import ConfigValueError

log = logging.getLogger("ninfer.server")

QUEUE_EVENTS = 65536
_STOP = object()


class RequestLogError(ConfigValueError):
    """The log file cannot be used; the message names the option and the reason."""


def open_request_log(path: str, artifact_path: str | None) -> RequestLog:
    target = Path(path).expanduser()
    parent = target.parent.resolve()
    if not parent.is_dir():
        raise RequestLogError(f"--request-log-jsonl {path}: the directory {parent} does not exist")
    resolved = parent / target.name
    if artifact_path is not None:
        artifact = Path(artifact_path).expanduser().resolve()
        if resolved == artifact or artifact in resolved.parents:
            raise RequestLogError(f"--request-log-jsonl {path}: the path is inside the model artifact {artifact}")
    try:
        file = open(resolved, "a", encoding="utf-8")  # noqa: SIM115 - owned by the writer thread
    except OSError as error:
        raise RequestLogError(f"--request-log-jsonl {path}: cannot open it for appending: {error}") from error
    return RequestLog(file)


class RequestLog:
    def __init__(self, file, max_queued: int = QUEUE_EVENTS):
        self.path = file.name
        self._file = file
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self.num_dropped = 0  # events lost to a full queue (the disk could not keep up)
        self.num_write_errors = 0
        self._thread = threading.Thread(target=self._write_loop, name="ninfer-request-log", daemon=True)
        self._thread.start()

    def record(self, event: dict[str, Any]) -> None:
        if event.get("event") == "throughput":
            event = {**event, "request_log_dropped_events": self.num_dropped}
        try:
            self._queue.put_nowait(json.dumps(event, separators=(",", ":"), allow_nan=False))
        except queue.Full:
            self.num_dropped += 1

    def _write_loop(self) -> None:
        while True:
            line = self._queue.get()
            if line is _STOP:
                return
            try:
                self._file.write(line + "\n")
                self._file.flush()
            except OSError:  # a full disk: count it, keep serving
                self.num_write_errors += 1
                if self.num_write_errors == 1:
                    log.exception("request log %s: write failed (further failures are counted)", self.path)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(10)
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except (OSError, ValueError):
            pass
        self._file.close()
