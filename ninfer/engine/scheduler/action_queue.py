"""ActionQueue: the slot and page actions the next step performs before its forward.

Admission queues its plan's context moves (spills, restores, copy-on-write, resets), placement
the spills that free a device slot, checkpoints the copies that capture a frontier, and the
commit of a speculative round its CommitVerified; the scheduler drains them all, in the order
they were queued, into the next SchedulerStep.
"""

from __future__ import annotations

from collections.abc import Iterator

from ninfer.engine.scheduler.step import SlotAction


class ActionQueue:
    def __init__(self) -> None:
        self._actions: list[SlotAction] = []

    def add(self, action: SlotAction) -> None:
        self._actions.append(action)

    def drain(self) -> list[SlotAction]:
        """Every queued action, in order; the queue is empty after."""
        actions, self._actions = self._actions, []
        return actions

    def clear(self) -> None:
        """Forget the queued actions (the steps that would have carried them failed)."""
        self._actions = []

    def since(self, mark: int) -> list[SlotAction]:
        """The actions queued after the first `mark` (a length read before queuing them)."""
        return self._actions[mark:]

    def __len__(self) -> int:
        return len(self._actions)

    def __iter__(self) -> Iterator[SlotAction]:
        return iter(self._actions)
