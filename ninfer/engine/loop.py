"""EngineLoop: drives an EngineCore from an inbox of messages, publishing outputs.

The same loop runs in a thread (in-process engine for tests and offline use) and as the
main function of the engine process. It blocks on the inbox only when idle and nothing is left
to do in idle turns (step graphs to capture).

Idle-turn work waits until the engine has been idle for a moment: a capture cannot be cut
short, so a request that arrives during one waits for it (0.2-0.5 s a 27B step graph, 3 s
with kernels to compile), and a client's next request (the first after ready, an agent's next
turn) mostly comes within a second of the last answer. Work deferred for long runs at the next
idle turn, so a steady stream of requests cannot keep the step graphs from ever existing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ninfer.contract.messages import Abort, AddRequest, Failed, FromEngine, Gauges, Outputs, Shutdown, Stats, ToEngine
from ninfer.engine.core import EngineCore

log = logging.getLogger("ninfer.engine")

IDLE_GRACE_S = 2.0  # idle this long before idle-turn work starts
MAX_DEFER_S = 30.0  # idle-turn work pending this long goes on in every idle turn, grace or not
_WAIT_RESOLUTION_S = 1e-3  # the engine process's inbox waits in whole milliseconds


class EngineLoop:
    def __init__(
        self,
        core: EngineCore,
        receive: Callable[[float | None], ToEngine | None],
        publish: Callable[[FromEngine], None],
        idle_grace_s: float = IDLE_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        """receive(timeout) returns the next message or None after timeout (None = block);
        idle_grace_s: how long the engine is idle before idle-turn work starts (module docstring)."""
        self.core = core
        self.receive = receive
        self.publish = publish
        self.idle_grace_s = idle_grace_s
        self.clock = clock

    def run(self) -> None:
        try:
            self._serve()
        finally:
            self.core.close()

    def _serve(self) -> None:
        reported_failure = False
        active_at = self.clock()  # the last message or step
        deferred_since: float | None = None  # idle-turn work pending since then
        while True:
            idle = not self.core.has_work
            # Idle, wake at the throughput boundary so the last busy interval is reported on time,
            # and, with tensor-parallel followers, to notice one that died. Idle with background
            # work (graphs to capture), do a piece of it once the grace is over unless a message
            # is waiting; within the grace, wake when it ends.
            timeout = _earliest(self.core.seconds_to_stats_boundary(), self.core.seconds_to_rank_check)
            pending = self.core.has_background_work
            background = idle and pending
            now = self.clock()
            if not pending:
                deferred_since = None
            elif deferred_since is None:
                deferred_since = now
            grace_left = self.idle_grace_s - (now - active_at)
            due = background and (grace_left < _WAIT_RESOLUTION_S or now - deferred_since >= MAX_DEFER_S)
            if not idle or due:
                wait = 0.0
            else:
                wait = _earliest(timeout, max(grace_left, 0.0) if background else None)
            message = self.receive(wait)
            if due and message is None:
                self.core.background_step()
            if message is not None or self.core.has_work:
                active_at = self.clock()
            if idle:
                self.core.log_stats_if_due()
            outputs = []
            while message is not None:
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, AddRequest):
                    outputs.extend(self.core.add_request(message.request))
                elif isinstance(message, Abort):
                    outputs.extend(self.core.abort(message.request_id))
                message = self.receive(0.0)
            outputs.extend(self.core.check_ranks())
            if self.core.has_work:
                outputs.extend(self.core.step())
            if outputs:
                self.publish(Outputs(outputs))
            for record in self.core.take_stats_records():
                self.publish(Stats(record))
            gauges = self.core.take_idle_gauges()
            if gauges is not None:
                self.publish(Gauges(gauges))
            if self.core.failed is not None and not reported_failure:
                reported_failure = True
                self.publish(Failed(self.core.failed))


def _earliest(*timeouts: float | None) -> float | None:
    """The shortest of the timeouts given (None: no timeout)."""
    given = [t for t in timeouts if t is not None]
    return min(given) if given else None
