"""CachePlanner: the context cache's one eviction policy.

Whatever takes checkpoints away asks the planner, and every answer comes from one drop order: a
device slot short at admission or capture (placement), KV pages short at admission, a full host
tier, and a capture that would pass a descriptor limit (CacheLimits).

The order weighs two things. When a checkpoint will be needed: its conversation's next turn, or
for a shared prefix its next use, in whole admissions (ContinuationForecast); the one needed
last goes first (Belady's rule, predicted). And what losing it costs: the recompute of the
tokens between it and the longest other checkpoint that is a prefix of it (a prompt-end
checkpoint a few tokens past its turn closure costs those few tokens), at the calibrated prefill
rate; a checkpoint that a longer, more recent one of the same prefix extends is superseded (a
request only needs it when it diverges between the two), so its loss counts at
SUPERSEDED_WEIGHT. Of those needed equally soon the cheapest loss goes first, then the least
recently used. The forecast comes first: with each loss spread over the admissions until it is
needed instead, long conversations that had stopped outweighed live ones resuming from shared
prefixes, whose losses are a tenth as large (docs/performance.md, agent sessions).

Spilling to the host instead of dropping pays off when restoring later (bytes over the host
link) costs less than the recompute; a full host tier gives up a checkpoint only for one later
in the drop order.

The descriptor limits are bounds on the same order, not an eviction of their own. A capture
that passes one drops the first group in the order that brings the cache back within it: a
whole conversation for --max-private-continuations (ranked by its next turn and by what its next
turn recomputes beyond the checkpoints of others), a shared prefix for --max-shared-prefixes, an
anchor of the conversation for --max-long-anchors-per-continuation. The new checkpoint is never
dropped: a capture whose own conversation comes first in the order is declined instead (admits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ninfer.contract.reuse_path import ReusePath
from ninfer.engine.cache.context_cache import Checkpoint, ContextCache
from ninfer.engine.cache.context_costs import ContextCosts

SUPERSEDED_WEIGHT = 0.1  # how likely a request diverges inside an extended prefix: an assumption
MAX_CANDIDATES = 64  # the search is bounded; past it, the least recently used count no loss


@dataclass(frozen=True)
class SlotRelease:
    """How one device slot is freed: `victim` leaves the device, its StateImage spilled to a host
    slot (once `host_victim`, if any, is dropped to make room there) or dropped."""

    victim: Checkpoint
    spill: bool
    host_victim: Checkpoint | None
    loss_seconds: float  # predicted later: the recompute dropped, or the restore (+ host_victim's recompute)


class CachePlanner:
    def __init__(self, cache: ContextCache, costs: ContextCosts, state_image_bytes: int, kv_page_bytes: int = 0):
        self.cache = cache
        self.costs = costs
        self.state_image_bytes = state_image_bytes
        self.kv_page_bytes = kv_page_bytes
        self._loss: tuple[int, dict[int, float]] | None = None  # (cache version, losses)
        # (shorter id, longer id) -> whether the shorter's tokens start the longer's: token ids never change.
        self._is_prefix: dict[tuple[int, int], bool] = {}

    # The drop order.

    def loss_seconds(self) -> dict[int, float]:
        """checkpoint_id -> expected seconds of recompute if it were dropped now and needed again."""
        if self._loss is None or self._loss[0] != self.cache.version:
            self._loss = (self.cache.version, self._compute_losses())
        return self._loss[1]

    def drop_ranks(self, current: str | None = None) -> dict[int, tuple[float, float]]:
        """checkpoint_id -> its place in the drop order, lowest first. `current`: the
        conversation whose request is being captured."""
        loss = self.loss_seconds()
        return {cid: self._rank(ck.forecast_key, loss[cid], current) for cid, ck in self.cache.checkpoints.items()}

    def _rank(self, key: str, loss_seconds: float, current: str | None) -> tuple[float, float]:
        """Needed last first (the most admissions until `key`'s next use), then the cheapest loss."""
        return -self.cache.forecast.turns_until(key, current=key == current), loss_seconds

    def _prefix_of(self, shorter: Checkpoint, longer: Checkpoint) -> bool:
        key = (shorter.checkpoint_id, longer.checkpoint_id)
        known = self._is_prefix.get(key)
        if known is None:
            known = _starts(longer.token_ids, shorter)
            if len(self._is_prefix) > 4096:  # forget pairs of long-gone checkpoints
                self._is_prefix.clear()
            self._is_prefix[key] = known
        return known

    def _compute_losses(self) -> dict[int, float]:
        checkpoints = sorted(self.cache.checkpoints.values(), key=lambda c: c.last_used, reverse=True)
        ranked, rest = checkpoints[:MAX_CANDIDATES], checkpoints[MAX_CANDIDATES:]
        by_frontier = sorted(ranked, key=lambda c: c.frontier)
        covered = {c.checkpoint_id: 0 for c in ranked}
        superseded: set[int] = set()
        for i, longer in enumerate(by_frontier):
            for shorter in by_frontier[:i]:
                if self._prefix_of(shorter, longer):
                    covered[longer.checkpoint_id] = max(covered[longer.checkpoint_id], shorter.frontier)
                    if longer.last_used > shorter.last_used:
                        superseded.add(shorter.checkpoint_id)
        loss = {}
        for c in ranked:
            weight = SUPERSEDED_WEIGHT if c.checkpoint_id in superseded else 1.0
            loss[c.checkpoint_id] = weight * self.costs.recompute_seconds(c.frontier - covered[c.checkpoint_id])
        for c in rest:
            loss[c.checkpoint_id] = 0.0  # beyond the search bound: oldest, ranked by recency
        return loss

    # Pressure: device slots, KV pages, the host tier.

    def drop_order(
        self, keep: Checkpoint | None = None, among: list[Checkpoint] | None = None, current: str | None = None
    ) -> list[Checkpoint]:
        """Lowest drop rank first; ties go to the least recently used. Never `keep`."""
        rank = self.drop_ranks(current)
        pool = among if among is not None else list(self.cache.checkpoints.values())
        candidates = [c for c in pool if c is not keep]
        return sorted(candidates, key=lambda c: (rank[c.checkpoint_id], c.last_used))

    def worth_spilling(self, checkpoint: Checkpoint, loss: dict[int, float] | None = None) -> bool:
        """Restoring from the host (later) costs less than recomputing what dropping it loses."""
        loss = loss if loss is not None else self.loss_seconds()
        return self.costs.transfer_seconds(self.state_image_bytes) < loss[checkpoint.checkpoint_id]

    def worth_spilling_kv(self, checkpoint: Checkpoint) -> bool:
        """Restoring its KV pages from the host costs less than recomputing what dropping it loses."""
        loss = self.loss_seconds()[checkpoint.checkpoint_id]
        return self.costs.transfer_seconds(len(checkpoint.pages) * self.kv_page_bytes) < loss

    def kv_spills(self, evict: list[Checkpoint]) -> list[Checkpoint]:
        """Of the checkpoints giving up their device pages, those whose KV goes to the host tier:
        while it has room, each worth more than restoring its pages would cost."""
        host = self.cache.host_kv_pool
        if host is None:
            return []
        room = host.num_free
        spill = []
        for c in evict:
            if c.pages and len(c.pages) <= room and self.worth_spilling_kv(c):
                spill.append(c)
                room -= len(c.pages)
        return spill

    def can_release_device_slot(self, keep: Checkpoint | None, evicted: list[Checkpoint]) -> bool:
        """Whether release_device_slot would find a victim once `evicted` are gone."""
        return any(
            c.state_slot is not None and c is not keep and c not in evicted for c in self.cache.checkpoints.values()
        )

    def release_device_slot(self, keep: Checkpoint | None = None, current: str | None = None) -> SlotRelease | None:
        """The first device checkpoint in the drop order other than `keep` leaves the device:
        whether it spills to the host tier or is dropped; None when no other holds a device slot."""
        on_device = [c for c in self.cache.checkpoints.values() if c.state_slot is not None]
        order = self.drop_order(keep=keep, among=on_device, current=current)
        if not order:
            return None
        victim = order[0]
        loss = self.loss_seconds()
        host_pool = self.cache.host_pool
        # Dropped, it costs its recompute later; spilled, its restore (plus any host checkpoint dropped for it).
        if host_pool.num_slots == 0 or not self.worth_spilling(victim, loss):
            return SlotRelease(victim, False, None, loss[victim.checkpoint_id])
        restore = self.costs.transfer_seconds(self.state_image_bytes)
        if host_pool.num_free > 0:
            return SlotRelease(victim, True, None, restore)
        on_host = self.drop_order(keep=keep, among=[c for c in self.cache.checkpoints.values() if c.on_host],
                                  current=current)
        rank = self.drop_ranks(current)
        if not on_host or rank[on_host[0].checkpoint_id] >= rank[victim.checkpoint_id]:
            return SlotRelease(victim, False, None, loss[victim.checkpoint_id])
        return SlotRelease(victim, True, on_host[0], restore + loss[on_host[0].checkpoint_id])

    # Descriptor limits: bounds on what the cache holds.

    def admits(self, path: ReusePath, continuation: str, token_ids: list[int]) -> bool:
        """Whether a checkpoint of this kind, for this conversation, may be kept: not under a
        limit of zero, nor when its conversation would be the first to give way under the
        continuation limit (else over_bounds drops the others' once it is kept)."""
        limits = self.cache.limits
        if path is ReusePath.SHARED_STABLE_PREFIX:
            return limits.max_shared_prefixes != 0
        if path is ReusePath.PRIVATE_LONG_ANCHOR and limits.max_long_anchors == 0:
            return False
        if limits.max_private_continuations is None:
            return True
        if limits.max_private_continuations == 0:
            return False
        return continuation not in self._conversations_giving_way(continuation, token_ids)

    def over_bounds(self, new: Checkpoint) -> list[tuple[Checkpoint, str]]:
        """What to drop, and the limit it goes for, so that every descriptor limit holds again
        now that `new` is in the cache: the first in the drop order, never `new`."""
        limits = self.cache.limits
        others = [c for c in self.cache.checkpoints.values() if c is not new]
        if new.shared:
            shared = [c for c in others if c.shared]
            over = _excess(len(shared) + 1, limits.max_shared_prefixes)
            return [(c, "--max-shared-prefixes") for c in self.drop_order(among=shared)[:over]]
        victims = []
        if new.path is ReusePath.PRIVATE_LONG_ANCHOR:
            anchors = [c for c in others if c.path is new.path and c.continuation == new.continuation]
            over = _excess(len(anchors) + 1, limits.max_long_anchors)
            first = self.drop_order(among=anchors, current=new.continuation)[:over]
            victims += [(c, "--max-long-anchors-per-continuation") for c in first]
        giving_way = self._conversations_giving_way(new.continuation, new=new)
        victims += [
            (c, "--max-private-continuations") for c in others if not c.shared and c.continuation in giving_way
        ]
        return victims

    def _conversations_giving_way(
        self, continuation: str, token_ids: list[int] | None = None, new: Checkpoint | None = None
    ) -> list[str]:
        """The conversations that must lose their private checkpoints so that `continuation`'s
        capture (`token_ids` about to be kept, or `new` just kept) stays within the continuation
        limit: the first in the drop order, `continuation` itself a candidate only before its
        capture is kept."""
        limit = self.cache.limits.max_private_continuations
        if limit is None:
            return []
        groups: dict[str, list[Checkpoint]] = {}
        for c in self.cache.checkpoints.values():
            if not c.shared and c is not new:
                groups.setdefault(c.continuation, []).append(c)
        if continuation in groups:
            return []  # it holds checkpoints already: no new conversation to bound
        over = _excess(len(groups) + 1, limit)
        if over == 0:
            return []
        rank = {
            name: (*self._rank(name, self._conversation_loss([c.token_ids for c in members], name), continuation),
                   max(c.last_used for c in members))
            for name, members in groups.items()
        }
        if new is None:  # the request being captured: the most recent
            rank[continuation] = (*self._rank(continuation, self._conversation_loss([token_ids], continuation),
                                              continuation), math.inf)
        return sorted(rank, key=rank.__getitem__)[:over]

    def _conversation_loss(self, histories: list[list[int]], continuation: str) -> float:
        """Seconds of recompute a conversation's next turn pays once its private checkpoints
        (holding `histories`) are gone: its longest history past the longest checkpoint of
        others (shared prefixes, other conversations) that starts it."""
        outside = [c for c in self.cache.checkpoints.values() if c.shared or c.continuation != continuation]
        recompute = 0
        for tokens in histories:
            covered = max((c.frontier for c in outside if _starts(tokens, c)), default=0)
            recompute = max(recompute, len(tokens) - covered)
        return self.costs.recompute_seconds(recompute)


def _starts(tokens: list[int], checkpoint: Checkpoint) -> bool:
    """The checkpoint's tokens are a proper prefix of `tokens`."""
    f = checkpoint.frontier
    return f < len(tokens) and tokens[f - 1] == checkpoint.token_ids[-1] and tokens[:f] == checkpoint.token_ids


def _excess(count: int, limit: int | None) -> int:
    """How far `count` passes `limit` (None: unbounded)."""
    return 0 if limit is None else max(0, count - limit)
