"""TokenCommit: one committed token of a request, and what it ends or forces.

Each token goes through the request's stop checker and output grammar; then the output
limit, and the thinking budget, which forces the close tokens once the thinking it counts
reaches its cap (the limit wins over the forced close).
"""

from __future__ import annotations

from ninfer.contract.output import EngineError, ErrorCode, FinishReason, TokenLogprobs
from ninfer.engine.scheduler.active_requests import ActiveRequests
from ninfer.engine.sequence import Sequence


class TokenCommit:
    def __init__(self, active: ActiveRequests):
        """active: where a token that ends its request finishes it."""
        self.active = active

    def commit(self, seq: Sequence, token_id: int, now: float, logprobs: TokenLogprobs | None = None) -> None:
        """A sampled token (with its log probabilities when the request asked for them)."""
        seq.timings.first_token = seq.timings.first_token or now
        seq.timings.last_token = now
        self._append(seq, token_id, forced=False, logprobs=logprobs)
        if seq.is_finished:
            return
        if seq.num_output_tokens >= seq.max_new_tokens:
            self.active.finish(seq, FinishReason.LENGTH)
            return
        self._count_thinking(seq, token_id)

    def _count_thinking(self, seq: Sequence, token_id: int) -> None:
        """Count a model token against the thinking budget; at the cap, close thinking without
        sampling (the close tokens are computed with the next step)."""
        budget = seq.request.thinking_budget
        if budget is None or not seq.thinking_open:
            return
        if token_id == budget.think_end_token_id:
            seq.thinking_open = False
            return
        seq.num_thinking_tokens += 1
        if seq.num_thinking_tokens >= budget.max_thinking_tokens:
            seq.thinking_open = False
            for forced in budget.close_token_ids:
                self._append(seq, forced, forced=True)
                if seq.is_finished:
                    return

    def _append(self, seq: Sequence, token_id: int, forced: bool, logprobs: TokenLogprobs | None = None) -> None:
        seq.token_ids.append(token_id)
        seq.unsent_token_ids.append(token_id)
        if seq.request.top_logprobs is not None:
            seq.unsent_logprobs.append(logprobs)
        if forced:
            seq.num_forced_tokens += 1
            seq.unsent_forced += 1
        stop = seq.stop_checker.append(token_id)
        seq.unsent_text += stop.text
        if seq.constraint is not None and not seq.constraint.accept(token_id):
            # The sampler only draws allowed tokens: a forced token outside the grammar, or a bug.
            self.active.finish(seq, FinishReason.ERROR, error=EngineError(
                ErrorCode.STEP_FAILED, f"token {token_id} is outside the request's output grammar"
            ))
            return
        if stop.stopped:
            self.active.finish(seq, FinishReason.STOP, stop.stop_reason)
