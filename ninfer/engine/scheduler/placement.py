"""Placement: which checkpoint gives up its device StateImage slot when a slot is needed.

Device slots are few (C active + the checkpoint pool) and a StateImage is what a hybrid
model cannot rebuild without recomputing its whole prefix, so under slot pressure the least
recently used device checkpoint spills its StateImage to a pinned host slot instead of being
dropped; its KV pages stay on the device. The host tier makes room by dropping its own least
recently used checkpoint; with no host slots the device checkpoint is dropped. The spill is
a SpillSlot action, ordered before any later action or forward that reuses the device slot.
"""

from __future__ import annotations

from ninfer.engine.context_cache import Checkpoint, ContextCache
from ninfer.engine.scheduler.step import SlotAction, SpillSlot


class Placement:
    def __init__(self, cache: ContextCache, actions: list[SlotAction]):
        """actions: the scheduler's list of slot actions to run before the next forward."""
        self.cache = cache
        self.actions = actions

    def can_free_device_slot(self, keep: Checkpoint | None, evicted: list[Checkpoint]) -> bool:
        """Whether free_device_slot would succeed once `evicted` are gone."""
        return any(c.state_slot is not None and c not in evicted for c in self.cache.victims(keep=keep))

    def free_device_slot(self, keep: Checkpoint | None = None) -> bool:
        """Free one device slot by spilling (or, without host room, dropping) the least recently
        used device checkpoint other than `keep`; False when no checkpoint holds a device slot."""
        on_device = [c for c in self.cache.victims(keep=keep) if c.state_slot is not None]
        if not on_device:
            return False
        victim = on_device[0]
        host_pool = self.cache.host_pool
        if host_pool.num_free == 0:
            on_host = [c for c in self.cache.victims(keep=keep) if c.on_host]
            if not on_host:
                self.cache.remove(victim)
                return True
            self.cache.remove(on_host[0])
        host_slot = host_pool.allocate()
        device_slot = self.cache.move_to_host(victim, host_slot)
        self.actions.append(SpillSlot(device_slot, host_slot))
        return True
