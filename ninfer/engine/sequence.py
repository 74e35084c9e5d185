"""Sequence: the engine's mutable view of one admitted request.

There is no separate prefill phase in the bookkeeping: token_ids holds prompt and
committed output, and every step computes token_ids[num_computed_tokens:] (a prompt
chunk, the last sampled token, or forced thinking-close tokens plus the last one).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from ninfer.contract.output import (
    EngineTiming,
    Materialization,
    PromptProgress,
    SpeculativeCounters,
    Timings,
    TokenLogprobs,
)
from ninfer.contract.request import EngineRequest
from ninfer.contract.reuse_path import ReusePath
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.constraint_state import ConstraintState
from ninfer.engine.speculative.draft_policy import DraftPolicy
from ninfer.models.mrope_positions import MediaPlacement, build_mrope_layout
from ninfer.engine.stop_checker import StopChecker


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request: EngineRequest
    max_new_tokens: int  # effective output limit (request limit clamped to the context ceiling)
    sampling: SamplingParams  # the request's, with the seed resolved
    stop_checker: StopChecker
    timings: Timings
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    reuse_path: ReusePath = ReusePath.ROOT
    continuation: str = ""  # the conversation its private checkpoints belong to (set at admission)
    pages: list[int] = field(default_factory=list)
    state_slot: int | None = None
    capture_frontiers: list[tuple[int, str]] = field(default_factory=list)  # ascending, still to capture
    snapshot: tuple[int, str, int] | None = None  # (frontier, path, slot) captured inside the chunk in flight
    num_thinking_tokens: int = 0  # model-origin tokens while thinking is open
    thinking_open: bool = False
    num_forced_tokens: int = 0
    logits_frontier: int = -1  # num_computed_tokens when the slot's stored logits were last written
    num_steps_in_flight: int = 0  # scheduled steps with a chunk of this request that update() has not seen
    # pending output delta (flushed to the client after each step)
    unsent_token_ids: list[int] = field(default_factory=list)
    unsent_text: str = ""
    unsent_forced: int = 0
    unsent_progress: PromptProgress | None = None
    unsent_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # with top_logprobs set
    constraint: ConstraintState | None = None  # its output grammar (structured outputs), once compiled
    engine_timing: EngineTiming = field(default_factory=EngineTiming)  # accumulated step by step
    materialization: Materialization | None = None  # the admission decision, once admitted
    materializing: bool = False  # admitted; the context moves its plan queued have not run yet
    draft_token_ids: list[int] = field(default_factory=list)  # proposals to follow the last committed token
    speculative: SpeculativeCounters | None = None  # set at admission when a backend is loaded
    draft_policy: DraftPolicy | None = None  # with adaptive drafts: whether its next round drafts
    # With media: the prompt's (t, h, w) rotary positions [3, prompt_len], and what every later
    # token adds to its index (negative: a media block advances the positions less than its tokens).
    rope_positions: np.ndarray | None = None
    rope_offset: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_token_ids)
            for item in self.request.media:
                # Media tokens carry their identity ids (contract/media.py): prefix reuse then
                # matches media by content, and the runner finds each token's tower row.
                ids = iter(item.identity_ids())
                for start, end in item.token_spans():
                    self.token_ids[start:end] = [next(ids) for _ in range(end - start)]
        if self.request.media and self.rope_positions is None:
            placements = [MediaPlacement(m.modality, m.grid_thw, m.token_starts[0]) for m in self.request.media]
            layout = build_mrope_layout(self.request.prompt_token_ids, placements)
            self.rope_positions, self.rope_offset = layout.positions().numpy(), layout.rope_delta
        self.thinking_open = self.request.thinking_budget is not None

    @property
    def has_media(self) -> bool:
        return bool(self.request.media)

    @property
    def decodes_plainly(self) -> bool:
        """Never drafts: a masked row's drafts would be verified against unmasked logits, and log
        probabilities come from plain sampling rows."""
        return self.request.constraint is not None or self.request.top_logprobs is not None

    def chunk_rope_positions(self, start: int, end: int) -> np.ndarray:
        """Rotary positions [3, end - start] of tokens [start, end) of a request with media."""
        prompt_end = min(end, self.prompt_len)
        parts = [self.rope_positions[:, start:prompt_end]] if start < prompt_end else []
        if end > self.prompt_len:
            later = np.arange(max(start, self.prompt_len), end, dtype=np.int64) + self.rope_offset
            parts.append(np.broadcast_to(later, (3, len(later))))
        return np.concatenate(parts, axis=1) if len(parts) > 1 else np.ascontiguousarray(parts[0])

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

