"""Placement: which checkpoint gives up its device StateImage slot when a slot is needed.

Device slots are few (C active + the checkpoint pool) and a StateImage is what a hybrid
model cannot rebuild without recomputing its whole prefix. Under slot pressure the device
checkpoint whose loss costs least (planner.py) leaves the device: it spills its StateImage to
a pinned host slot when restoring it later is cheaper than recomputing what it saves, and is
dropped otherwise; its KV pages stay on the device. A full host tier makes room by dropping its
cheapest checkpoint when that one is worth less than the one arriving. The spill is a
SpillSlot action, ordered before any later action or forward that reuses the device slot.
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
        return any(c.state_slot is not None and c is not keep and c not in evicted for c in self.cache.checkpoints.values())

    def free_device_slot(self, keep: Checkpoint | None = None) -> bool:
        """Free one device slot from the cheapest device checkpoint other than `keep` (spilled or
        dropped); False when no other checkpoint holds a device slot."""
        on_device = [c for c in self.cache.checkpoints.values() if c.state_slot is not None]
        order = self.planner.drop_order(keep=keep, among=on_device)
        if not order:
            return False
        victim = order[0]
        loss = self.planner.loss_seconds()
        host_pool = self.cache.host_pool
        # Dropped, it costs its recompute later; spilled, its restore (plus any host checkpoint dropped for it).
        self.last_loss_seconds = loss[victim.checkpoint_id]
        if host_pool.num_slots == 0 or not self.planner.worth_spilling(victim, loss):
            self._drop(victim)
            return True
        restore = self.planner.costs.transfer_seconds(self.planner.state_image_bytes)
        self.last_loss_seconds = restore
        if host_pool.num_free == 0:
            on_host = self.planner.drop_order(keep=keep, among=[c for c in self.cache.checkpoints.values() if c.on_host])
            if not on_host or loss[on_host[0].checkpoint_id] >= loss[victim.checkpoint_id]:
                self.last_loss_seconds = loss[victim.checkpoint_id]
                self._drop(victim)
                return True
            self._drop(on_host[0])
            self.last_loss_seconds = restore + loss[on_host[0].checkpoint_id]
        host_slot = host_pool.allocate()
        device_slot = self.cache.move_to_host(victim, host_slot)
        self.actions.add(SpillSlot(device_slot, host_slot))
        self.cache.counters.degrade(victim.shared, "state_spills")
        self.num_spills += 1
        log.debug("cache: checkpoint %d (%d tokens, %s) spills its state to host slot %d (loss if dropped %.3fs)",
                  victim.checkpoint_id, victim.frontier, victim.path, host_slot, loss[victim.checkpoint_id])
        return True

    def _drop(self, checkpoint: Checkpoint) -> None:
        log.debug("cache: checkpoint %d (%d tokens, %s) dropped to free a device slot", checkpoint.checkpoint_id,
                  checkpoint.frontier, checkpoint.path)
        self.cache.remove(checkpoint)
        self.cache.counters.degrade(checkpoint.shared, "evictions")
        self.num_drops += 1
