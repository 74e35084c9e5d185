"""Placement: frees a device StateImage slot the way the cache planner chooses.

Device slots are few (C active + the checkpoint pool) and a StateImage is what a hybrid
model cannot rebuild without recomputing its whole prefix. Which checkpoint leaves the device,
and whether it spills to a pinned host slot or is dropped, is the planner's choice
(CachePlanner.release_device_slot); placement carries it out. The spill is a SpillSlot action,
ordered before any later action or forward that reuses the device slot; the checkpoint's KV
pages stay on the device.
"""

from __future__ import annotations

import logging

from ninfer.engine.cache.context_cache import Checkpoint, ContextCache
from ninfer.engine.cache.planner import CachePlanner
from ninfer.engine.scheduler.action_queue import ActionQueue
from ninfer.engine.scheduler.step import SpillSlot

log = logging.getLogger("ninfer.engine")


class Placement:
    def __init__(self, cache: ContextCache, planner: CachePlanner, actions: ActionQueue):
        """actions: where the spills go, to run before the next forward."""
        self.cache = cache
        self.planner = planner
        self.actions = actions
        self.num_spills = self.num_drops = 0  # for tests and diagnostics
        self.last_loss_seconds = 0.0  # what the last freed slot is predicted to cost later

    def can_free_device_slot(self, keep: Checkpoint | None, evicted: list[Checkpoint]) -> bool:
        """Whether free_device_slot would succeed once `evicted` are gone."""
        return self.planner.can_release_device_slot(keep, evicted)

    def free_device_slot(self, keep: Checkpoint | None = None, current: str | None = None) -> bool:
        """Free one device slot from a device checkpoint other than `keep` (spilled or dropped);
        False when no other checkpoint holds a device slot. current: the conversation whose
        request is being captured."""
        release = self.planner.release_device_slot(keep, current)
        if release is None:
            return False
        self.last_loss_seconds = release.loss_seconds
        victim = release.victim
        loss = self.planner.loss_seconds()[victim.checkpoint_id]
        if not release.spill:
            self._drop(victim)
            return True
        if release.host_victim is not None:
            self._drop(release.host_victim)
        host_slot = self.cache.host_pool.allocate()
        device_slot = self.cache.move_to_host(victim, host_slot)
        self.actions.add(SpillSlot(device_slot, host_slot))
        self.cache.counters.degrade(victim.shared, "state_spills")
        self.num_spills += 1
        log.debug("cache: checkpoint %d (%d tokens, %s) spills its state to host slot %d (loss if dropped %.3fs)",
                  victim.checkpoint_id, victim.frontier, victim.path, host_slot, loss)
        return True

    def _drop(self, checkpoint: Checkpoint) -> None:
        log.debug("cache: checkpoint %d (%d tokens, %s) dropped to free a device slot", checkpoint.checkpoint_id,
                  checkpoint.frontier, checkpoint.path)
        self.cache.remove(checkpoint)
        self.cache.counters.degrade(checkpoint.shared, "evictions")
        self.num_drops += 1
