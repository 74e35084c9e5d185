"""SchedulerLimits: the lanes, context and token budgets the scheduler plans within."""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer.engine.speculative.round_costs import RoundCosts


@dataclass(frozen=True)
class SchedulerLimits:
    max_concurrency: int
    max_context: int
    prefill_chunk: int  # prompt tokens of a step with no decode rows
    prefix_reuse: bool = True
    mixed_prefill_chunk: int = 1024  # tokens of a step with decode rows, theirs included
    spec_backend: str | None = None  # speculative backend (mtp, dflash, dflash2) or None
    num_draft_tokens: int = 0  # drafts a speculative round verifies per request
    adaptive_drafts: bool = False  # requests draft only while it pays (DraftPolicy)
    round_costs: RoundCosts = field(default_factory=RoundCosts)  # what DraftPolicy weighs a round at

    def mixed_prompt_budget(self, num_decode_tokens: int) -> int:
        """Prompt tokens of a step beside num_decode_tokens decode tokens: the step holds
        mixed_prefill_chunk tokens in all, so a power-of-two budget fills a step graph's bucket
        exactly (the 27B's matmuls cost 13% more at 1,032 rows than at 1,024), but at least half
        of them are prompt tokens."""
        return max(self.mixed_prefill_chunk - num_decode_tokens, -(-self.mixed_prefill_chunk // 2))
