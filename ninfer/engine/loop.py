"""EngineLoop: drives an EngineCore from an inbox of messages, publishing outputs.

The same loop runs in a thread (in-process engine for tests and offline use) and as the
main function of the engine process. It blocks on the inbox only when idle and nothing is left
to do in idle turns (step graphs to capture).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ninfer.contract.messages import Abort, AddRequest, Failed, FromEngine, Gauges, Outputs, Shutdown, Stats, ToEngine
from ninfer.engine.core import EngineCore

log = logging.getLogger("ninfer.engine")


class EngineLoop:
    def __init__(
        self,
        core: EngineCore,
        receive: Callable[[float | None], ToEngine | None],
        publish: Callable[[FromEngine], None],
    ):
        """receive(timeout) returns the next message or None after timeout (None = block)."""
        self.core = core
        self.receive = receive
        self.publish = publish

    def run(self) -> None:
        try:
            self._serve()
        finally:
            self.core.close()

    def _serve(self) -> None:
        reported_failure = False
        while True:
            idle = not self.core.has_work
            # Idle, wake at the throughput boundary so the last busy interval is reported on time,
            # and, with tensor-parallel followers, to notice one that died. Idle with background
            # work (graphs to capture), do a piece of it unless a message is waiting.
            background = idle and self.core.has_background_work
            timeout = _earliest(self.core.seconds_to_stats_boundary(), self.core.seconds_to_rank_check)
            message = self.receive(timeout if idle and not background else 0.0)
            if background and message is None:
                self.core.background_step()
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
