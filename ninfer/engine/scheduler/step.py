"""SchedulerStep: the typed contract between the scheduler and the runner.

A step names which tokens of which requests to compute, where their KV pages and state
slots are, which rows to sample, and the slot/page actions to perform before the forward.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ninfer.contract.media import MediaInput
from ninfer.contract.sampling import SamplingParams


class StepKind(enum.Enum):
    PREFILL = "prefill"  # prompt chunks only
    DECODE = "decode"  # one row per decode-ready request only (CUDA graphs replay these)
    MIXED = "mixed"  # decode rows and prompt chunks in one forward


class _Action:
    """What every slot action tells the scheduler: the device slots and pages it writes (a failed
    step leaves them unknown) and whether it moves context from elsewhere (a copy or a transfer)."""

    moves_context: ClassVar[bool] = True

    def device_slots_written(self) -> tuple[int, ...]:
        return ()

    def device_pages_written(self) -> tuple[int, ...]:
        return ()


@dataclass(frozen=True)
class ResetSlot(_Action):
    slot: int

    moves_context: ClassVar[bool] = False

    def device_slots_written(self) -> tuple[int, ...]:
        return (self.slot,)


@dataclass(frozen=True)
class CopySlot(_Action):
    """Copy a whole StateImage (recurrent + conv state and the stored last logits)."""

    src: int
    dst: int

    def device_slots_written(self) -> tuple[int, ...]:
        return (self.dst,)


@dataclass(frozen=True)
class CopyPage(_Action):
    src: int
    dst: int

    def device_pages_written(self) -> tuple[int, ...]:
        return (self.dst,)


@dataclass(frozen=True)
class SpillSlot(_Action):
    """Copy a device StateImage (and its stored logits) to a pinned host slot; the device slot is
    then free for other use, so the copy is ordered before any later action or forward."""

    device_slot: int
    host_slot: int


@dataclass(frozen=True)
class RestoreSlot(_Action):
    """Copy a host StateImage back into a device slot, ordered before the forward that reads it."""

    host_slot: int
    device_slot: int

    def device_slots_written(self) -> tuple[int, ...]:
        return (self.device_slot,)


@dataclass(frozen=True)
class SpillPages(_Action):
    """Copy device KV pages to pinned host pages (pairwise); the device pages are then free."""

    device_pages: tuple[int, ...]
    host_pages: tuple[int, ...]


@dataclass(frozen=True)
class RestorePages(_Action):
    """Copy host KV pages back into device pages (pairwise), before the forward that reads them."""

    host_pages: tuple[int, ...]
    device_pages: tuple[int, ...]

    def device_pages_written(self) -> tuple[int, ...]:
        return self.device_pages


@dataclass(frozen=True)
class CommitVerified(_Action):
    """Advance a slot by the first num_rows verification rows of the last speculative step
    (from row `row` of its verification scratch), and take that last row's logits and hidden
    state as the slot's: the state after exactly the tokens the scheduler committed."""

    slot: int
    row: int
    num_rows: int

    moves_context: ClassVar[bool] = False  # the slot advances in place

    def device_slots_written(self) -> tuple[int, ...]:
        return (self.slot,)


SlotAction = ResetSlot | CopySlot | CopyPage | SpillSlot | RestoreSlot | SpillPages | RestorePages | CommitVerified


# The token of a chained chunk: sampled by the previous step, not yet known on the host.
PENDING_TOKEN = -1


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    token_ids: list[int]  # the tokens to compute now (empty: sample from the slot's stored logits)
    num_computed_tokens: int
    page_ids: list[int]
    state_slot: int
    compute_logits: bool  # keep the last row's logits in the slot (for sampling or a capture)
    sample: bool
    sampling: SamplingParams  # seed always set (the engine draws one when the request has none)
    num_generated: int  # RNG position: model-sampled tokens so far
    # For presence/frequency penalties (empty when the request has none): the committed output;
    # a chained row's input, still in flight, counts too (the runner adds it on the device).
    output_token_ids: list[int]
    # Set by schedule_ahead: token_ids is [PENDING_TOKEN], and the token to compute is the one
    # the previously launched step sampled in this row.
    previous_row: int | None = None
    # A speculative round: token_ids is the pending token and K draft places, of which the first
    # num_draft_tokens hold drafts to verify (the rest filler, never accepted); the runner
    # returns the accepted tokens and new drafts (VerifyOutcome) instead of one sampled id.
    speculative: bool = False
    num_draft_tokens: int = 0
    # A request with media: its tokens' rotary positions [3, len(token_ids)] (eager steps), what
    # a decode row adds to its index for them (graph replays), and the items whose tokens this
    # chunk computes (their identity ids stand in token_ids; the runner encodes their patches).
    rope_positions: np.ndarray | None = None
    rope_offset: int = 0
    media: tuple[MediaInput, ...] = ()
    # A checkpoint captured inside this chunk: after its first snapshot_tokens tokens, the slot's
    # StateImage and that row's logits are copied into snapshot_slot, and the rest of the chunk
    # continues from the state (models/step_snapshots.py). Prompt chunks without media only.
    snapshot_tokens: int = 0
    snapshot_slot: int | None = None
    # A sampling row of a request with an active output constraint: the tokens its grammar allows
    # ([ceil(V / 32)] int32, bit v set where token v is allowed); the sampler masks the rest.
    token_bitmask: np.ndarray | None = None
    # A chained row of a request with an output constraint: its mask follows the token the
    # previous row samples, so the runner computes the row and samples it once the scheduler
    # has committed that token and given the mask (Scheduler.masks_after_commit).
    mask_follows_previous: bool = False
    # The sampled token's log probability and this many alternatives are returned (None: not asked).
    logprobs: int | None = None


@dataclass(frozen=True)
class VerifyOutcome:
    """What a speculative row produced: the accepted drafts followed by the target's token after
    them (at least that one token), and the drafts proposed to follow tokens[-1]."""

    tokens: list[int]
    drafts: list[int]


@dataclass(frozen=True)
class SchedulerStep:
    kind: StepKind
    chunks: list[ScheduledChunk]
    # Performed in order before the forward: restores, copy-on-write, resets, and the
    # snapshots captured at the previous step's frontiers (nothing has run since).
    before: list[SlotAction] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)
