"""CachePlanner: what losing each checkpoint would cost, so pressure takes the cheapest first.

A dropped checkpoint costs the recompute of the tokens between it and the longest other
checkpoint that is a prefix of it (a prompt-end checkpoint a few tokens past its turn closure
costs those few tokens). A checkpoint that a longer, more recent one of the same prefix extends
is superseded: a request only needs it when it diverges between the two, so its cost counts at
SUPERSEDED_WEIGHT. Spilling a StateImage to the host instead of dropping it pays off only when
restoring it later (bytes over the host link) is cheaper than that recompute.
"""

from __future__ import annotations

from ninfer.engine.cache.context_cache import Checkpoint, ContextCache
from ninfer.engine.cache.context_costs import ContextCosts

SUPERSEDED_WEIGHT = 0.1  # how likely a request diverges inside an extended prefix: an assumption
MAX_CANDIDATES = 64  # the search is bounded; past it, the least recently used are ranked by recency alone


class CachePlanner:
    def __init__(self, cache: ContextCache, costs: ContextCosts, state_image_bytes: int, kv_page_bytes: int = 0):
        self.cache = cache
        self.costs = costs
        self.state_image_bytes = state_image_bytes
        self.kv_page_bytes = kv_page_bytes
        self._loss: tuple[int, dict[int, float]] | None = None  # (cache version, losses)
        # (shorter id, longer id) -> whether the shorter's tokens start the longer's: token ids never change.
        self._is_prefix: dict[tuple[int, int], bool] = {}

    def loss_seconds(self) -> dict[int, float]:
        """checkpoint_id -> expected seconds of recompute if it were dropped now."""
        if self._loss is None or self._loss[0] != self.cache.version:
            self._loss = (self.cache.version, self._compute_losses())
        return self._loss[1]

    def _prefix_of(self, shorter: Checkpoint, longer: Checkpoint) -> bool:
        key = (shorter.checkpoint_id, longer.checkpoint_id)
        known = self._is_prefix.get(key)
        if known is None:
            f = shorter.frontier
            known = f < longer.frontier and longer.token_ids[f - 1] == shorter.token_ids[-1]
            known = known and longer.token_ids[:f] == shorter.token_ids
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

    def drop_order(self, keep: Checkpoint | None = None, among: list[Checkpoint] | None = None) -> list[Checkpoint]:
        """Cheapest loss first; ties go to the least recently used. Never `keep`."""
        loss = self.loss_seconds()
        pool = among if among is not None else list(self.cache.checkpoints.values())
        candidates = [c for c in pool if c is not keep]
        return sorted(candidates, key=lambda c: (loss[c.checkpoint_id], c.last_used))

    def worth_spilling(self, checkpoint: Checkpoint, loss: dict[int, float] | None = None) -> bool:
        """Restoring from the host (later) costs less than recomputing what dropping it loses."""
        loss = loss if loss is not None else self.loss_seconds()
        return self.costs.transfer_seconds(self.state_image_bytes) < loss[checkpoint.checkpoint_id]

    def worth_spilling_kv(self, checkpoint: Checkpoint) -> bool:
        """Restoring its KV pages from the host costs less than recomputing what dropping it loses."""
        loss = self.loss_seconds()[checkpoint.checkpoint_id]
        return self.costs.transfer_seconds(len(checkpoint.pages) * self.kv_page_bytes) < loss
