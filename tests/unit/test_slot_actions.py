"""Slot actions name what they write on the device (what a failed step leaves unknown) and
whether they move context from elsewhere (an admitted request materializes until they run)."""

from __future__ import annotations

from ninfer.engine.scheduler.step import (
    CommitVerified,
    CopyPage,
    CopySlot,
    ResetSlot,
    RestorePages,
    RestoreSlot,
    SpillPages,
    SpillSlot,
)


def test_each_action_names_the_device_slots_and_pages_it_writes() -> None:
    cases = [
        (ResetSlot(3), (3,), ()),
        (CopySlot(src=1, dst=2), (2,), ()),
        (CopyPage(src=5, dst=6), (), (6,)),
        (SpillSlot(device_slot=1, host_slot=0), (), ()),  # writes the host tier only
        (RestoreSlot(host_slot=0, device_slot=4), (4,), ()),
        (SpillPages(device_pages=(7, 8), host_pages=(0, 1)), (), ()),
        (RestorePages(host_pages=(0, 1), device_pages=(9, 10)), (), (9, 10)),
        (CommitVerified(slot=2, row=0, num_rows=3), (2,), ()),
    ]
    for action, slots, pages in cases:
        assert action.device_slots_written() == slots, action
        assert action.device_pages_written() == pages, action


def test_only_copies_and_transfers_move_context() -> None:
    moving = [CopySlot(1, 2), CopyPage(5, 6), SpillSlot(1, 0), RestoreSlot(0, 4), SpillPages((7,), (0,)),
              RestorePages((0,), (9,))]
    assert all(a.moves_context for a in moving)
    assert not ResetSlot(3).moves_context and not CommitVerified(2, 0, 3).moves_context
