"""ActionQueue: slot and page actions leave in the order they were queued, once."""

from __future__ import annotations

from ninfer.engine.scheduler.action_queue import ActionQueue
from ninfer.engine.scheduler.step import CopySlot, ResetSlot, SpillSlot


def test_drain_returns_the_actions_in_order_and_empties_the_queue() -> None:
    queue = ActionQueue()
    assert not queue
    queue.add(SpillSlot(1, 0))
    mark = len(queue)
    queue.add(CopySlot(2, 1))
    queue.add(ResetSlot(3))
    assert queue.since(mark) == [CopySlot(2, 1), ResetSlot(3)]
    drained = queue.drain()
    assert drained == [SpillSlot(1, 0), CopySlot(2, 1), ResetSlot(3)]
    assert not queue and queue.drain() == []
    queue.add(ResetSlot(4))
    assert drained == [SpillSlot(1, 0), CopySlot(2, 1), ResetSlot(3)]  # a drained list is the step's own


def test_clear_forgets_the_queued_actions() -> None:
    queue = ActionQueue()
    queue.add(ResetSlot(1))
    queue.clear()
    assert list(queue) == []
