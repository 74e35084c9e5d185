"""ActiveRequests: the admitted requests that hold KV pages and a state slot.

Running requests, in admission order, take part in steps. A request that finishes while a
launched step still computes for it (decode overlap) drains: its pages and slot stay held
until that step lands, then they are released or kept as its endpoint checkpoint.
"""

from __future__ import annotations

from ninfer.contract.output import EngineError, FinishReason
from ninfer.engine.scheduler.checkpoints import Checkpoints
from ninfer.engine.scheduler.outputs import Outbox, final_output
from ninfer.engine.sequence import Sequence, SequenceStatus


class ActiveRequests:
    def __init__(self, checkpoints: Checkpoints, outbox: Outbox):
        """checkpoints: where a finished request's pages and slot go; outbox: where its final
        output goes."""
        self.checkpoints = checkpoints
        self.outbox = outbox
        self.running: list[Sequence] = []
        self.draining: dict[str, Sequence] = {}  # by request id

    def running_by_id(self) -> dict[str, Sequence]:
        return {s.request_id: s for s in self.running}

    def by_id(self) -> dict[str, Sequence]:
        """Running and draining requests: each one a launched step may have computed for."""
        return {**self.draining, **self.running_by_id()}

    def finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        stop_reason: int | str | None = None,
        error: EngineError | None = None,
    ) -> None:
        """seq stops running: it drains while a launched step still writes its pages and slot,
        else they are released or kept now; its final output goes to the outbox."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        if reason is FinishReason.LENGTH or reason is FinishReason.CANCELLED:
            seq.unsent_text += seq.stop_checker.flush()
        self.running.remove(seq)
        if seq.num_steps_in_flight:
            self.draining[seq.request_id] = seq
        else:
            self.checkpoints.release_or_capture_endpoint(seq)
        out = final_output(seq, reason, stop_reason)
        out.error = error
        self.outbox.add(out)
