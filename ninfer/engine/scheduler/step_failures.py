"""StepFailures: what launched steps that failed on the device leave behind.

Their requests end with STEP_FAILED, and so does every request whose slot or pages their
slot and page actions were preparing (each action names what it writes on the device);
nothing those wrote is kept. Which actions ran is unknown, so every checkpoint is dropped too
(a capture or spill may be half-written); requests outside the steps keep their own slots and
pages and go on.
"""

from __future__ import annotations

from ninfer.contract.output import EngineError, ErrorCode, FinishReason
from ninfer.engine.cache.context_cache import ContextCache
from ninfer.engine.kv_pool import KVPool
from ninfer.engine.scheduler.action_queue import ActionQueue
from ninfer.engine.scheduler.active_requests import ActiveRequests
from ninfer.engine.scheduler.checkpoints import Checkpoints
from ninfer.engine.scheduler.outputs import Outbox, final_output
from ninfer.engine.scheduler.step import SchedulerStep
from ninfer.engine.sequence import Sequence, SequenceStatus
from ninfer.engine.state_pool import StatePool


class StepFailures:
    def __init__(
        self,
        active: ActiveRequests,
        checkpoints: Checkpoints,
        actions: ActionQueue,
        kv_pool: KVPool,
        state_pool: StatePool,
        cache: ContextCache,
        outbox: Outbox,
    ):
        self.active = active
        self.checkpoints = checkpoints
        self.actions = actions
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.cache = cache
        self.outbox = outbox

    def fail(self, steps: list[SchedulerStep], message: str) -> None:
        """End the steps' requests and those their actions touched; their errors go to the outbox."""
        failed_ids = self._failed_ids(steps)
        self.actions.clear()
        for seq in [*self.active.running, *self.active.draining.values()]:
            if seq.request_id in failed_ids:
                self._end(seq, message)
        self.active.draining.clear()
        self.cache.clear()

    def _failed_ids(self, steps: list[SchedulerStep]) -> set[str]:
        """The steps' requests, and the running ones whose slot or pages their actions write."""
        failed_ids = {c.request_id for step in steps for c in step.chunks}
        touched_slots: set[int] = set()
        touched_pages: set[int] = set()
        for step in steps:
            for action in step.before:
                touched_slots.update(action.device_slots_written())
                touched_pages.update(action.device_pages_written())
        for seq in self.active.running:
            if seq.state_slot in touched_slots or touched_pages.intersection(seq.pages):
                failed_ids.add(seq.request_id)
        return failed_ids

    def _end(self, seq: Sequence, message: str) -> None:
        """seq ends with STEP_FAILED (unless it had finished) and gives up its pages and slot."""
        if not seq.is_finished:
            seq.status = SequenceStatus.FINISHED
            self.active.running.remove(seq)
            out = final_output(seq, FinishReason.ERROR)
            out.error = EngineError(ErrorCode.STEP_FAILED, message)
            self.outbox.add(out)
        seq.num_steps_in_flight = 0
        self.checkpoints.release_snapshot(seq)
        self.kv_pool.release(seq.pages)
        if seq.state_slot is not None:
            self.state_pool.release(seq.state_slot)
        seq.pages, seq.state_slot = [], None
