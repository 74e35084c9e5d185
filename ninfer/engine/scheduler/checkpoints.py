"""Checkpoints: when an active request leaves a checkpoint behind, and what it costs.

Two capture kinds (context cache): a snapshot at a prompt frontier (the prompt end and
the API's capture hints), which copies the active state slot after the step that reached
it, or inside the step when the chunk goes on past the frontier (ScheduledChunk's
snapshot); and the request's endpoint when it finishes, which hands its slot and pages over
to the cache instead of releasing them (no copy). Whether a capture is kept under the
descriptor limits, and what gives way for it, is the cache planner's choice (admits,
over_bounds).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable

from ninfer.contract.request import CaptureHint
from ninfer.contract.reuse_path import ReusePath
from ninfer.engine.cache.context_cache import Checkpoint, ContextCache
from ninfer.engine.host_detail import HostDetail
from ninfer.engine.kv_pool import KVPool
from ninfer.engine.scheduler.action_queue import ActionQueue
from ninfer.engine.scheduler.placement import Placement
from ninfer.engine.scheduler.step import CopySlot
from ninfer.engine.sequence import Sequence
from ninfer.engine.state_pool import StatePool

log = logging.getLogger("ninfer.engine")

# Each capture frontier inside a prompt ends a prompt step there, and a prompt step costs at
# least what ~1K tokens of prefill do on a GPU (its host work). A long anchor (a heuristic) this
# close to another frontier is not worth its step: a later hit recomputes at most this much.
ANCHOR_MIN_GAP = 256
# A turn closure this close after the implicit cache candidate differs from it by template
# markers only (the end of the last message's text vs. the message's end marker).
CLOSURE_MIN_GAP = 16


class Snapshot(enum.Enum):
    """Why a capture at a frontier gets no device slot (Checkpoints.reserve_snapshot)."""

    NOT_NEEDED = "not_needed"
    NO_SLOT = "no_slot"


def capture_frontiers(
    hints: Iterable[CaptureHint], reused: int, prompt_len: int, endpoint_path: ReusePath
) -> list[tuple[int, ReusePath]]:
    """(frontier, path) where a prompt resumed at `reused` leaves checkpoints, ascending; the
    prompt end always.

    Frontiers a few tokens apart would each take a prompt step for next to nothing, so the
    implicit cache candidate (a shared prefix no client asked for, at the end of the last
    message's text) is left to a turn closure at most CLOSURE_MIN_GAP tokens after it, which any
    later request sharing that prefix also reaches; and a long anchor within ANCHOR_MIN_GAP of
    the reuse point or of any frontier kept is left out. Breakpoints a client asked for and turn
    closures are always captured.
    """
    frontiers: dict[int, CaptureHint] = {prompt_len: CaptureHint(prompt_len, ReusePath(endpoint_path))}
    for hint in hints:
        if reused < hint.frontier <= prompt_len:
            frontiers[hint.frontier] = hint
    closures = [f for f, hint in frontiers.items() if hint.path is ReusePath.PRIVATE_TURN_CLOSURE]
    kept = {
        f: ReusePath(hint.path) for f, hint in frontiers.items()
        if f == prompt_len or not hint.implicit or not any(0 < c - f <= CLOSURE_MIN_GAP for c in closures)
    }  # fmt: skip
    fixed = [f for f, path in kept.items() if path is not ReusePath.PRIVATE_LONG_ANCHOR]
    for f, path in list(kept.items()):
        if path is ReusePath.PRIVATE_LONG_ANCHOR and (
            f - reused <= ANCHOR_MIN_GAP or any(abs(f - other) <= ANCHOR_MIN_GAP for other in fixed)
        ):
            del kept[f]
    return sorted(kept.items())


class Checkpoints:
    def __init__(
        self,
        prefix_reuse: bool,
        kv_pool: KVPool,
        state_pool: StatePool,
        cache: ContextCache,
        placement: Placement,
        actions: ActionQueue,
        detail: HostDetail | None = None,
    ):
        """actions: where capture copies go, to run before the next forward; detail: where
        captures are timed (context transactions)."""
        self.prefix_reuse = prefix_reuse
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.cache = cache
        self.placement = placement
        self.actions = actions
        self.detail = detail if detail is not None else HostDetail()

    def capture_prompt_frontiers(self, seq: Sequence) -> None:
        """Snapshot the frontiers the last prefill chunk reached (chunks end at frontiers)."""
        while seq.capture_frontiers and seq.capture_frontiers[0][0] <= seq.num_computed_tokens:
            frontier, path = seq.capture_frontiers.pop(0)
            if frontier == seq.num_computed_tokens:
                with self.detail.timed("context_transaction"):
                    self._capture_copy(seq, frontier, path)

    def _capture_copy(self, seq: Sequence, frontier: int, path) -> None:
        slot = self._capture_slot(seq, frontier, path)
        if isinstance(slot, Snapshot):
            return  # nothing to keep, or every device slot is active: skip this capture
        self._insert(seq, frontier, path, slot, "")
        # Runs before the next forward, so it still sees the state right after this frontier.
        self.actions.add(CopySlot(seq.state_slot, slot))

    def reserve_snapshot(self, seq: Sequence, frontier: int, path) -> int | Snapshot:
        """Ready a capture at `frontier` inside the chunk being scheduled: the device slot it
        will be copied into (also kept in seq.snapshot until the step has run), NOT_NEEDED when
        the cache would not keep it or holds those tokens already (the chunk simply goes on), or
        NO_SLOT (the chunk then ends at the frontier, to capture it after the step)."""
        slot = self._capture_slot(seq, frontier, path)
        if not isinstance(slot, Snapshot):
            seq.snapshot = (frontier, path, slot)
        return slot

    def keep_snapshot(self, seq: Sequence) -> None:
        """The step with seq's snapshot has run: its slot holds the StateImage at the frontier."""
        with self.detail.timed("context_transaction"):
            self._keep_snapshot(seq)

    def _keep_snapshot(self, seq: Sequence) -> None:
        frontier, path, slot = seq.snapshot
        seq.snapshot = None
        existing = self.cache.find_identical(seq.token_ids[:frontier])  # captured by another request meanwhile
        if existing is not None:
            self.cache.touch(existing)
            self.state_pool.release(slot)
            return
        self._insert(seq, frontier, path, slot, " inside its step")

    def _capture_slot(self, seq: Sequence, frontier: int, path) -> int | Snapshot:
        """A device slot for a checkpoint of seq at `frontier`, or why there is none to take."""
        tokens = seq.token_ids[:frontier]
        if not self.placement.planner.admits(ReusePath(path), seq.continuation, tokens):
            self.cache.decline(seq.continuation, tokens)
            return Snapshot.NOT_NEEDED
        existing = self.cache.find_identical(tokens)
        if existing is not None:
            self.cache.touch(existing)
            return Snapshot.NOT_NEEDED
        if self.state_pool.num_free == 0 and not self.placement.free_device_slot(current=seq.continuation):
            return Snapshot.NO_SLOT
        return self.state_pool.allocate()

    def _insert(self, seq: Sequence, frontier: int, path, slot: int, where: str) -> None:
        """Register seq's checkpoint at `frontier` in `slot`, sharing its pages up to there."""
        pages = seq.pages[: self.kv_pool.pages_for(frontier)]
        self.kv_pool.share(pages)
        ck = self.cache.insert(seq.token_ids[:frontier], pages, slot, ReusePath(path), seq.request.session_key,
                               seq.continuation)
        log.debug("cache: %s captures checkpoint %d at %d tokens%s (%s)", seq.request_id, ck.checkpoint_id, frontier,
                  where, ReusePath(path).value)
        self._bound(ck)

    def _bound(self, new: Checkpoint) -> None:
        """Back within the descriptor limits after `new`: drop what the planner chooses."""
        for victim, limit in self.placement.planner.over_bounds(new):
            log.debug("cache: checkpoint %d (%d tokens, %s) dropped for %s, keeping checkpoint %d",
                      victim.checkpoint_id, victim.frontier, ReusePath(victim.path).value, limit, new.checkpoint_id)
            self.cache.remove(victim)

    def release_snapshot(self, seq: Sequence) -> None:
        """Give up seq's snapshot slot (its step failed, or seq ended while the step ran)."""
        if seq.snapshot is not None:
            self.state_pool.release(seq.snapshot[2])
            seq.snapshot = None

    def release_or_capture_endpoint(self, seq: Sequence) -> None:
        """A finished request's pages and slot: kept as its endpoint checkpoint when the slot holds
        the logits of its last computed token and no identical checkpoint exists; else released."""
        with self.detail.timed("context_transaction"):
            self._release_or_capture_endpoint(seq)

    def _release_or_capture_endpoint(self, seq: Sequence) -> None:
        frontier = seq.num_computed_tokens
        keep = (
            self.prefix_reuse
            and frontier > 0
            and seq.logits_frontier == frontier
            and self.cache.find_identical(seq.token_ids[:frontier]) is None
        )
        path = ReusePath(seq.request.endpoint_path)
        if keep and not self.placement.planner.admits(path, seq.continuation, seq.token_ids[:frontier]):
            self.cache.decline(seq.continuation, seq.token_ids[:frontier])
            keep = False
        if keep:
            num_pages = self.kv_pool.pages_for(frontier)
            self.kv_pool.release(seq.pages[num_pages:])
            ck = self.cache.insert(
                seq.token_ids[:frontier],
                seq.pages[:num_pages],
                seq.state_slot,
                path,
                seq.request.session_key,
                seq.continuation,
            )
            self._bound(ck)
        else:
            self.kv_pool.release(seq.pages)
            self.state_pool.release(seq.state_slot)
        seq.pages = []
        seq.state_slot = None
