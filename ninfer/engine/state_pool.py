"""StatePool: allocation of StateImage slots (the storage is the runner's StateCache).

Device capacity is C active + H checkpoint slots. An active request always owns one slot; the
rest hold checkpoints. Models without recurrent layers still account slots this way, so
checkpoint bounds are the same for every architecture. The pinned host tier is a second
pool of the same kind (it may be empty).
"""

from __future__ import annotations


class StatePoolError(RuntimeError):
    """Accounting invariant broken (a bug, never a client error)."""


class StatePool:
    def __init__(self, num_slots: int):
        if num_slots < 0:
            raise ValueError("a state pool cannot have a negative number of slots")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise StatePoolError("no free state slot")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._used:
            raise StatePoolError(f"releasing free slot {slot}")
        self._used.remove(slot)
        self._free.append(slot)

    def check_balanced(self) -> None:
        if len(self._free) + len(self._used) != self.num_slots or set(self._free) & self._used:
            raise StatePoolError("slot accounting does not add up")
