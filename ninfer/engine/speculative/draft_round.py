"""DraftRound: what a drafter sees after a speculative step's target forward.

The step's computed chunks come verification rows first (one per speculative request:
its pending tokens, then the drafts it verified), then prompt chunks. A drafter keeps its
own context for every chunk (the MTP head's KV at the same positions) and proposes the next
drafts of each verification row, after the tokens the target just accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.engine.sampler import SamplingBatch
from ninfer.engine.scheduler import ScheduledChunk
from ninfer.models.forward_batch import ForwardBatch


@dataclass
class DraftRound:
    chunks: list[ScheduledChunk]  # the computed chunks, verification rows first
    num_verify: int  # how many of them are verification rows
    row_starts: list[int]  # each chunk's first flat row in the target batch
    target_batch: ForwardBatch
    input_ids: torch.Tensor  # [T] the target's input tokens
    hidden: torch.Tensor  # [T, H] the target's final-normed hidden states
    slot_hidden: torch.Tensor  # [num_slots, H]: each slot's hidden at its last computed position
    num_accepted: torch.Tensor  # [num_verify] drafts accepted per verification row
    tokens: torch.Tensor  # [num_verify, K+1]: accepted drafts, then the target's token after them
    sampling: SamplingBatch  # one row per verification request: the request's filters
    draft_noise: torch.Tensor  # [num_verify, 2K, C]: Exp(1) draws for output positions gen + 1 .. gen + 2K

    def pending_lengths(self) -> list[int]:
        """Tokens before the drafts in each verification row (the last committed one, and any forced)."""
        return [len(c.token_ids) - c.num_draft_tokens for c in self.chunks[: self.num_verify]]

    def noise_for(self, step: int) -> SamplingBatch:
        """The sampling rows with the draws for draft `step` (1-based) after the accepted tokens:
        output position gen + num_accepted + step, whatever this round accepted."""
        index = (self.num_accepted + (step - 1)).view(-1, 1, 1).expand(-1, 1, self.draft_noise.shape[-1])
        noise = self.draft_noise.gather(1, index).squeeze(1)
        return SamplingBatch(
            num_rows=self.sampling.num_rows,
            row_floats=self.sampling.row_floats,
            top_ks=self.sampling.top_ks,
            is_greedy=self.sampling.is_greedy,
            noise=noise,
            penalty_rows=None,
            penalty_token_ids=None,
            all_greedy=self.sampling.all_greedy,
            any_greedy=self.sampling.any_greedy,
            has_penalties=False,
        )
