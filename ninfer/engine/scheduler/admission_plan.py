"""AdmissionPlan: what admitting a request takes; PlanCommit carries one out.

A plan names the cache hit a request resumes from (or none: the root), whether it adopts the
hit's checkpoint or copies its state, the pages it reuses, copies and allocates, and the
checkpoints that give up their device pages or slot for it. Committing it reserves those pages
and a state slot for the request, queues the context moves that fill them (ordered before its
first step), updates the cache's bookkeeping and starts the sequence.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ninfer.contract.output import PromptProgress, SpeculativeCounters
from ninfer.contract.reuse_path import ReusePath
from ninfer.engine.cache.context_cache import CacheHit, Checkpoint, ContextCache
from ninfer.engine.kv_pool import KVPool
from ninfer.engine.scheduler.action_queue import ActionQueue
from ninfer.engine.scheduler.checkpoints import capture_frontiers
from ninfer.engine.scheduler.limits import SchedulerLimits
from ninfer.engine.scheduler.placement import Placement
from ninfer.engine.scheduler.step import CopyPage, CopySlot, ResetSlot, RestorePages, RestoreSlot, SpillPages
from ninfer.engine.sequence import Sequence, SequenceStatus
from ninfer.engine.speculative.draft_policy import DraftPolicy
from ninfer.engine.state_pool import StatePool

log = logging.getLogger("ninfer.engine")


@dataclass(frozen=True)
class AdmissionPlan:
    hit: CacheHit | None
    adopt: bool  # take over the checkpoint's slot and pages instead of copying its state
    num_full_pages: int  # fully reused pages, shared (or, when adopting, taken over)
    own_partial: bool  # the adopted checkpoint's partial last page is written in place
    cow: bool  # the hit's partial last page is copied into the first private page
    num_private_pages: int
    evict: list[Checkpoint]  # give up their device KV pages: dropped, or spilled when in spill_kv
    spill_kv: list[Checkpoint]
    free_device_slot: bool  # spill (or drop) one more device checkpoint for the request's slot
    stop_reason: str = "no_pressure"  # how the eviction search ended (Materialization.stop_reason)
    budget_exhausted: bool = False  # more checkpoints than the planner ranks by cost


class PlanCommit:
    def __init__(
        self,
        limits: SchedulerLimits,
        kv_pool: KVPool,
        state_pool: StatePool,
        cache: ContextCache,
        placement: Placement,
        actions: ActionQueue,
        clock: Callable[[], float],
    ):
        """actions: where a plan's context moves go, to run before the next forward."""
        self.limits = limits
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.cache = cache
        self.placement = placement
        self.actions = actions
        self.clock = clock
        self._continuations = itertools.count()

    def commit(self, seq: Sequence, plan: AdmissionPlan) -> None:
        """Carry out a plan: pages and a slot for seq, the context moves that fill them queued
        before its first step, the cache's bookkeeping, and seq started."""
        ck = plan.hit.checkpoint if plan.hit is not None else None
        first_action = len(self.actions)
        if ck is not None and self.cache.forks_history(ck, seq.token_ids):
            self.cache.counters.historical_forks += 1
        shared = self._hold_prefix(plan)
        self._evict(plan)
        if plan.free_device_slot and not self.placement.free_device_slot(keep=ck):
            raise AssertionError("admission planned a device slot that placement cannot free")
        if ck is not None and ck.kv_on_host:
            shared = self._restore_kv(plan)
        self._assign_pages_and_slot(seq, plan, shared)
        seq.reuse_path = ck.path if ck is not None else ReusePath.ROOT
        # Context moves for it (a restore, a copy, victims spilled) run before its first step.
        seq.materializing = any(a.moves_context for a in self.actions.since(first_action))
        self._log_admission(seq, plan)
        self._count_reuse(plan.hit)
        self._join_continuation(seq, ck)
        self._start(seq, plan.hit)

    def _hold_prefix(self, plan: AdmissionPlan) -> list[int]:
        """The hit's fully reused pages, shared now unless adopted: held before anything is
        evicted that might release them."""
        ck = plan.hit.checkpoint if plan.hit is not None else None
        shared = ck.pages[: plan.num_full_pages] if ck is not None else []
        if ck is not None and not plan.adopt:
            self.kv_pool.share(shared)
        return shared

    def _evict(self, plan: AdmissionPlan) -> None:
        """The plan's victims give up their device pages: spilled to the host tier or dropped."""
        for victim in plan.evict:
            if victim in plan.spill_kv:
                host_pages = self.cache.host_kv_pool.allocate(len(victim.pages))
                device_pages = self.cache.move_kv_to_host(victim, host_pages)
                self.actions.add(SpillPages(tuple(device_pages), tuple(host_pages)))
                self.cache.counters.degrade(victim.shared, "kv_spills")
            else:
                self.cache.remove(victim)
                self.cache.counters.degrade(victim.shared, "evictions")

    def _restore_kv(self, plan: AdmissionPlan) -> list[int]:
        """Bring the hit's spilled KV back into fresh device pages and hold its prefix there.
        Queued after the evictions' spills: a page they gave up may be reused here."""
        ck = plan.hit.checkpoint
        device_pages = self.kv_pool.allocate(len(ck.host_pages))
        host_pages = self.cache.move_kv_to_device(ck, device_pages)
        self.actions.add(RestorePages(tuple(host_pages), tuple(device_pages)))
        return self._hold_prefix(plan)

    def _assign_pages_and_slot(self, seq: Sequence, plan: AdmissionPlan, shared: list[int]) -> None:
        """seq's pages (the reused prefix, then private pages) and its state slot."""
        ck = plan.hit.checkpoint if plan.hit is not None else None
        cow_src = ck.pages[plan.num_full_pages] if plan.cow else None
        private = self.kv_pool.allocate(plan.num_private_pages)
        if cow_src is not None:
            # Runs before any forward writes, so the source still holds the prefix's tokens.
            self.actions.add(CopyPage(cow_src, private[0]))
            self.cache.counters.cow_pages += 1
        if plan.adopt:
            self.cache.remove(ck, release_resources=False)  # its page references and slot become ours
            if cow_src is not None:
                self.kv_pool.release([cow_src])
            seq.pages = ck.pages[: plan.num_full_pages + (1 if plan.own_partial else 0)] + private
            seq.state_slot = ck.state_slot
        else:
            seq.pages = shared + private
            seq.state_slot = self.state_pool.allocate()
            self._fill_slot(seq, plan.hit)

    def _fill_slot(self, seq: Sequence, hit: CacheHit | None) -> None:
        """seq's own slot starts from the hit's StateImage (restored or copied) at an exact
        frontier, else empty."""
        if hit is None or not hit.is_exact_frontier:
            self.actions.add(ResetSlot(seq.state_slot))
            return
        ck = hit.checkpoint
        if ck.on_host:
            self.actions.add(RestoreSlot(ck.host_slot, seq.state_slot))
            self.cache.counters.state_restores += 1
        else:
            self.actions.add(CopySlot(ck.state_slot, seq.state_slot))
        self.cache.touch(ck)

    def _log_admission(self, seq: Sequence, plan: AdmissionPlan) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        ck = plan.hit.checkpoint if plan.hit is not None else None
        log.debug(
            "admit %s: prompt %d, reuse %d from %s%s · %d private pages%s%s",
            seq.request_id, seq.prompt_len, plan.hit.num_reused_tokens if plan.hit is not None else 0,
            f"checkpoint {ck.checkpoint_id} ({ReusePath(ck.path).value})" if ck is not None else "root",
            " (adopted)" if plan.adopt else "", plan.num_private_pages,
            f" · evicts {len(plan.evict)} ({len(plan.spill_kv)} KV to host)" if plan.evict else "",
            " · copy-on-write" if plan.cow else "",
        )

    def _count_reuse(self, hit: CacheHit | None) -> None:
        counters = self.cache.counters
        if hit is None:
            counters.misses += 1
            return
        counters.hits[ReusePath(hit.checkpoint.path).value] += 1
        counters.hit_tokens += hit.num_reused_tokens

    def _join_continuation(self, seq: Sequence, ck: Checkpoint | None) -> None:
        """The conversation seq's private checkpoints will belong to."""
        if ck is not None and not ck.shared:
            seq.continuation = ck.continuation  # resuming a private checkpoint continues its conversation
        else:
            recalled = self.cache.forecast.recall(seq.token_ids) if self.limits.prefix_reuse else None
            seq.continuation = recalled or f"c{next(self._continuations)}"
        self.cache.note_admission(seq.continuation, seq.token_ids)

    def _start(self, seq: Sequence, hit: CacheHit | None) -> None:
        """seq runs from the reused prefix: its counters, timings and capture frontiers."""
        reused = hit.num_reused_tokens if hit is not None else 0
        seq.num_computed_tokens = seq.num_cached_tokens = reused
        if hit is not None and hit.is_exact_frontier:
            seq.logits_frontier = reused
        seq.status = SequenceStatus.RUNNING
        if self.limits.spec_backend is not None:
            draft_window = self.limits.num_draft_tokens
            seq.speculative = SpeculativeCounters(
                self.limits.spec_backend, draft_window, accepted_per_position=[0] * draft_window
            )
            if self.limits.adaptive_drafts:
                seq.draft_policy = DraftPolicy(draft_window, costs=self.limits.round_costs)
        seq.timings.admitted = self.clock()
        if reused == seq.prompt_len:
            seq.timings.prompt_done = seq.timings.admitted
        if self.limits.prefix_reuse and reused < seq.prompt_len:
            seq.capture_frontiers = capture_frontiers(
                seq.request.capture_hints, reused, seq.prompt_len, seq.request.endpoint_path
            )
        # The first progress event reports the reuse choice: processed == cache.
        seq.unsent_progress = PromptProgress(seq.prompt_len, reused, reused, 0.0)
