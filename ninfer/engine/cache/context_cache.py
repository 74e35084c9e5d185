"""ContextCache: checkpoints a later request can resume from (design: context-cache.md).

A checkpoint at frontier F holds the exact token ids [0, F), references to the KV pages
covering them, and one StateImage after token F-1 together with that position's logits (so
an exact full-prompt hit can sample without recomputing). The StateImage lives in a device
slot or, once spilled under pressure (the planner decides, planner.py), in a pinned host slot.
Recurrent state cannot be cut mid-way, so hybrid models only reuse at F exactly; pure
attention models may reuse any common prefix (KV is valid position by position).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

from ninfer.common_prefix import common_prefix_len
from ninfer.contract.reuse_path import ReusePath
from ninfer.engine.cache.cache_counters import CacheCounters
from ninfer.engine.cache.continuation_forecast import ContinuationForecast
from ninfer.engine.kv_pool import KVPool
from ninfer.engine.state_pool import StatePool

log = logging.getLogger("ninfer.engine")


@dataclass
class Checkpoint:
    checkpoint_id: int
    token_ids: list[int]  # identity: the exact tokens [0, F)
    pages: list[int]  # KV pages covering [0, F), one reference held by this checkpoint
    state_slot: int | None  # device slot of the StateImage; None while it lives on the host
    path: ReusePath
    session_key: str | None
    last_used: int = 0
    host_slot: int | None = None  # pinned host slot of the StateImage once spilled
    continuation: str = ""  # the conversation a private checkpoint belongs to
    host_pages: list[int] | None = None  # host KV pages holding [0, F) once spilled (pages is then empty)

    @property
    def kv_on_host(self) -> bool:
        return self.host_pages is not None

    @property
    def shared(self) -> bool:
        return self.path is ReusePath.SHARED_STABLE_PREFIX

    @property
    def on_host(self) -> bool:
        return self.host_slot is not None

    @property
    def frontier(self) -> int:
        return len(self.token_ids)

    @property
    def forecast_key(self) -> str:
        """Its name in the forecast: its conversation, or for a shared prefix its own (a use of
        it is counted as a conversation's turn is)."""
        return f"shared:{self.checkpoint_id}" if self.shared else self.continuation


@dataclass(frozen=True)
class CacheHit:
    checkpoint: Checkpoint
    num_reused_tokens: int

    @property
    def is_exact_frontier(self) -> bool:
        """Reuse ends at the checkpoint's frontier, so its state slot applies."""
        return self.num_reused_tokens == self.checkpoint.frontier


@dataclass(frozen=True)
class CacheLimits:
    """Descriptor limits (None: unbounded): bounds on what the cache holds, which the planner's
    choices respect (planner.py). A continuation is one conversation: a request that resumes
    from a private checkpoint continues its conversation, and so does one whose prompt extends a
    prefix its conversation lost to these limits (ContinuationForecast.recall); any other starts
    a new one."""

    max_private_continuations: int | None = None  # conversations holding private checkpoints
    max_shared_prefixes: int | None = None  # shared stable-prefix checkpoints, engine-wide
    max_long_anchors: int | None = None  # long-anchor checkpoints per continuation


@dataclass
class ContextCache:
    kv_pool: KVPool
    state_pool: StatePool
    exact_frontier_only: bool  # True for models with recurrent state
    enabled: bool = True
    host_pool: StatePool = field(default_factory=lambda: StatePool(0))  # pinned host StateImages
    limits: CacheLimits = field(default_factory=CacheLimits)
    host_kv_pool: KVPool | None = None  # pinned host KV pages (None: no host KV tier)
    checkpoints: dict[int, Checkpoint] = field(default_factory=dict)
    version: int = 0  # changes whenever a checkpoint is added, removed or used (planner caches by it)
    counters: CacheCounters = field(default_factory=CacheCounters)
    forecast: ContinuationForecast = field(default_factory=ContinuationForecast)
    _ids: itertools.count = field(default_factory=itertools.count)
    _clock: itertools.count = field(default_factory=lambda: itertools.count(1))

    def __len__(self) -> int:
        return len(self.checkpoints)

    def lookup(self, prompt: list[int], session_key: str | None = None) -> CacheHit | None:
        """The checkpoint that lets this prompt skip the most tokens (ties: same session, then newest)."""
        hits = self.lookup_all(prompt, session_key)
        return hits[0] if hits else None

    def lookup_all(self, prompt: list[int], session_key: str | None = None) -> list[CacheHit]:
        """Every checkpoint this prompt can resume from, best first (lookup's order): admission
        falls back to a shorter one when pressure leaves no room to keep the best."""
        if not self.enabled:
            return []
        ranked: list[tuple[tuple[int, bool, int], CacheHit]] = []
        for ck in self.checkpoints.values():
            frontier = ck.frontier
            if frontier == 0:
                continue
            if self.exact_frontier_only:
                if frontier > len(prompt) or prompt[:frontier] != ck.token_ids:
                    continue
                reused = frontier
            else:
                common = common_prefix_len(ck.token_ids, prompt)
                # Logits are kept only at the frontier: a full-prompt hit elsewhere recomputes one token.
                reused = common if common == frontier or common < len(prompt) else common - 1
                if reused <= 0:
                    continue
            key = (reused, session_key is not None and ck.session_key == session_key, ck.last_used)
            ranked.append((key, CacheHit(ck, reused)))
        ranked.sort(key=lambda entry: entry[0], reverse=True)
        return [hit for _, hit in ranked]

    def forks_history(self, checkpoint: Checkpoint, prompt: list[int]) -> bool:
        """Resuming `checkpoint` for this prompt branches its conversation off an older turn: a later
        checkpoint of the same conversation exists that the prompt does not extend."""
        if checkpoint.shared:
            return False
        for other in self.checkpoints.values():
            if other.shared or other.continuation != checkpoint.continuation or other.frontier <= checkpoint.frontier:
                continue
            f = other.frontier
            if f > len(prompt) or prompt[f - 1] != other.token_ids[-1] or prompt[:f] != other.token_ids:
                return True
        return False

    def note_admission(self, continuation: str, prompt: list[int]) -> None:
        """A request of this conversation was admitted: a turn for the forecast, and a use of every
        shared prefix its prompt extends (whichever checkpoint it resumes from)."""
        self.forecast.note_turn(continuation)
        for ck in self.checkpoints.values():
            if ck.shared and ck.frontier <= len(prompt) and prompt[: ck.frontier] == ck.token_ids:
                self.forecast.note_use(ck.forecast_key)

    def touch(self, checkpoint: Checkpoint) -> None:
        checkpoint.last_used = next(self._clock)
        self.version += 1

    def find_identical(self, token_ids: list[int]) -> Checkpoint | None:
        for ck in self.checkpoints.values():
            if ck.frontier == len(token_ids) and ck.token_ids == token_ids:
                return ck
        return None

    def decline(self, continuation: str, token_ids: list[int]) -> None:
        """A private capture the planner refused (CachePlanner.admits): its conversation keeps its
        identity for the limit."""
        log.debug("cache: no checkpoint at %d tokens: conversation %s is the one past the limit", len(token_ids),
                  continuation)
        if self.limits.max_private_continuations:
            self.forecast.remember(continuation, token_ids)

    def insert(
        self,
        token_ids: list[int],
        pages: list[int],
        state_slot: int,
        path: ReusePath,
        session_key: str | None,
        continuation: str = "",
    ) -> Checkpoint:
        """Register a checkpoint; it takes over one reference to each page and the slot. The
        descriptor limits are the caller's to restore (CachePlanner.over_bounds)."""
        ck = Checkpoint(next(self._ids), list(token_ids), list(pages), state_slot, path, session_key)
        ck.continuation = continuation
        self.touch(ck)
        self.checkpoints[ck.checkpoint_id] = ck
        self.counters.captures[ReusePath(path).value] += 1
        if ck.shared:
            self.forecast.note_use(ck.forecast_key)  # captured for the request using it now
        return ck

    def remove(self, checkpoint: Checkpoint, release_resources: bool = True) -> None:
        """Drop a checkpoint; with release_resources False the caller adopts its pages and slot."""
        del self.checkpoints[checkpoint.checkpoint_id]
        self.version += 1
        if release_resources:
            self.counters.drops += 1
            if not checkpoint.shared and self.limits.max_private_continuations:
                self.forecast.remember(checkpoint.continuation, checkpoint.token_ids)
        else:
            self.counters.adoptions += 1
        if release_resources:
            self.kv_pool.release(checkpoint.pages)
            if checkpoint.host_pages is not None:
                self.host_kv_pool.release(checkpoint.host_pages)
            if checkpoint.state_slot is not None:
                self.state_pool.release(checkpoint.state_slot)
            if checkpoint.host_slot is not None:
                self.host_pool.release(checkpoint.host_slot)

    def move_kv_to_host(self, checkpoint: Checkpoint, host_pages: list[int]) -> list[int]:
        """Record a KV spill: [0, F) now lives in host_pages; returns the device pages it gave up
        (released: a page another owner shares stays allocated to them)."""
        if checkpoint.host_pages is not None or len(host_pages) != len(checkpoint.pages):
            raise ValueError(f"checkpoint {checkpoint.checkpoint_id}: cannot move its KV to the host")
        device_pages = checkpoint.pages
        self.kv_pool.release(device_pages)
        checkpoint.pages, checkpoint.host_pages = [], list(host_pages)
        self.counters.kv_spills += 1
        return device_pages

    def move_kv_to_device(self, checkpoint: Checkpoint, device_pages: list[int]) -> list[int]:
        """Record a KV restore into freshly allocated device pages; returns the host pages it freed."""
        host_pages = checkpoint.host_pages
        if host_pages is None or len(device_pages) != len(host_pages):
            raise ValueError(f"checkpoint {checkpoint.checkpoint_id}: cannot move its KV to the device")
        self.host_kv_pool.release(host_pages)
        checkpoint.pages, checkpoint.host_pages = list(device_pages), None
        self.counters.kv_restores += 1
        return host_pages

    def move_to_host(self, checkpoint: Checkpoint, host_slot: int) -> int:
        """Record a spill: the checkpoint's StateImage now lives in host_slot; returns the freed device slot."""
        device_slot = checkpoint.state_slot
        if device_slot is None or checkpoint.host_slot is not None:
            raise ValueError(f"checkpoint {checkpoint.checkpoint_id} is not on the device")
        self.state_pool.release(device_slot)
        checkpoint.state_slot, checkpoint.host_slot = None, host_slot
        self.counters.state_spills += 1
        return device_slot

    def pages_freed_by_evicting(self, victims: list[Checkpoint]) -> list[int]:
        """Cumulative free-page gain after evicting victims[0..i] (pages shared elsewhere free nothing)."""
        remaining_refs: dict[int, int] = {}
        gains: list[int] = []
        freed = 0
        for ck in victims:
            for page in ck.pages:
                refs = remaining_refs.setdefault(page, self.kv_pool.refcount(page)) - 1
                remaining_refs[page] = refs
                if refs == 0:
                    freed += 1
            gains.append(freed)
        return gains

    def clear(self) -> None:
        """Drop every checkpoint; the forecast keeps the conversations' pace (after a failed step
        they are still the server's traffic)."""
        for ck in list(self.checkpoints.values()):
            self.remove(ck)

    def reset(self) -> None:
        """As before any request: no checkpoint and no forecast (the warm-up's synthetic
        conversations, a turn every admission, would set the pace assumed for real ones)."""
        self.clear()
        self.forecast = ContinuationForecast()
