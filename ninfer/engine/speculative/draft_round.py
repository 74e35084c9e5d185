"""DraftRound: what a drafter sees after a speculative step's target forward.

The step's computed chunks come verification rows first (one per speculative request:
its pending token, then K draft places), then prompt chunks. A drafter keeps its
own context for every chunk (the MTP head's KV at the same positions) and proposes the next
drafts of each verification row, after the tokens the target just accepted. Everything but
`chunks` is on the device, so the verify graphs can capture a drafter that reads only those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.engine.sampler import SamplingBatch
from ninfer.engine.scheduler import ScheduledChunk
from ninfer.engine.speculative.spec_plan import SpecInputs
from ninfer.models.forward_batch import ForwardBatch


@dataclass
class DraftRound:
    num_verify: int  # verification rows (they lead the step)
    target_batch: ForwardBatch | None  # None after a replayed step graph (no verification rows)
    input_ids: torch.Tensor  # [T] the target's input tokens
    hidden: torch.Tensor  # [T, H] the target's final-normed hidden states
    slot_hidden: torch.Tensor  # [num_slots, H]: each slot's hidden at its last computed position
    num_accepted: torch.Tensor | None  # [num_verify] drafts accepted per verification row
    tokens: torch.Tensor | None  # [num_verify, K+1]: accepted drafts, then the target's token after them
    inputs: SpecInputs
    chunks: list[ScheduledChunk] | None = None  # the host's view, eager steps only (test drafters read it)

    def noise_for(self, step: int) -> SamplingBatch:
        """The drafts' sampling rows with the draws for draft `step` (1-based) after the accepted
        tokens: output position gen + num_accepted + step, whatever this round accepted."""
        sampling, draws = self.inputs.request_sampling, self.inputs.draft_noise
        index = (self.num_accepted + (step - 1)).view(-1, 1, 1).expand(-1, 1, draws.shape[-1])
        return SamplingBatch(
            num_rows=sampling.num_rows,
            row_floats=sampling.row_floats,
            top_ks=sampling.top_ks,
            is_greedy=sampling.is_greedy,
            noise=draws.gather(1, index).squeeze(1),
            penalty_rows=None,
            penalty_token_ids=None,
            all_greedy=sampling.all_greedy,
            any_greedy=sampling.any_greedy,
            has_penalties=False,
        )
