"""StepCommit: a landed step's results applied to its requests.

Prompt chunks advance their requests' prompts (captures, progress); a sampling row commits its
token (TokenCommit), a verification row its round (Speculation). A request that finished while
the step computed for it has its pages and slot released, or kept as its endpoint checkpoint,
once its last launched step lands.
"""

from __future__ import annotations

from collections.abc import Callable

from ninfer.contract.output import FinishReason, PromptProgress, TokenLogprobs
from ninfer.engine.scheduler.active_requests import ActiveRequests
from ninfer.engine.scheduler.checkpoints import Checkpoints
from ninfer.engine.scheduler.speculation import Speculation, verify_rows
from ninfer.engine.scheduler.stats import SchedulerStats
from ninfer.engine.scheduler.step import ScheduledChunk, SchedulerStep, VerifyOutcome
from ninfer.engine.scheduler.token_commit import TokenCommit
from ninfer.engine.sequence import Sequence


class StepCommit:
    def __init__(
        self,
        active: ActiveRequests,
        checkpoints: Checkpoints,
        stats: SchedulerStats,
        tokens: TokenCommit,
        speculation: Speculation,
        clock: Callable[[], float],
    ):
        self.active = active
        self.checkpoints = checkpoints
        self.stats = stats
        self.tokens = tokens
        self.speculation = speculation
        self.clock = clock

    def land(
        self,
        step: SchedulerStep,
        sampled: dict[str, int],
        verified: dict[str, VerifyOutcome] | None = None,
        logprobs: dict[str, TokenLogprobs] | None = None,
    ) -> None:
        """Apply the runner's sampled tokens (request id -> token), speculative outcomes and the
        log probabilities of the rows that asked for them, for a finished step."""
        now = self.clock()
        for seq in self.active.running:
            seq.materializing = False  # the first update after an admission is its step's: the moves ran
        rows = verify_rows(step)
        by_id = self.active.by_id()
        num_decode_rows = 0
        for chunk in step.chunks:
            seq = by_id.get(chunk.request_id)
            if seq is None or not self._arrives(seq, chunk):
                continue
            if chunk.speculative:
                num_decode_rows += 1
                self.speculation.commit(seq, chunk, verified[chunk.request_id], rows[chunk.request_id], now)
                continue
            num_decode_rows += self._land_plain(seq, chunk, sampled, logprobs or {}, now)
        if num_decode_rows:
            self.stats.decode_rounds += 1
            self.stats.decode_rows += num_decode_rows

    def _arrives(self, seq: Sequence, chunk: ScheduledChunk) -> bool:
        """The step has landed for seq: True when its chunk is to be committed; a request that
        finished meanwhile is released or kept once its last launched step lands instead."""
        seq.num_steps_in_flight -= 1
        if not seq.is_finished:
            return True
        if seq.num_steps_in_flight == 0:
            self._land_after_finish(self.active.draining.pop(seq.request_id), chunk)
        else:
            self.checkpoints.release_snapshot(seq)  # cancelled while the step ran
        return False

    def _land_plain(
        self, seq: Sequence, chunk: ScheduledChunk, sampled: dict[str, int], logprobs: dict[str, TokenLogprobs],
        now: float,
    ) -> bool:
        """Commit a prompt chunk or a plain decode row; whether it was a decode row. A decode row
        computes the last committed token; a row with nothing to compute samples a full-prompt
        hit's stored logits: its first token, like a prefill's."""
        was_prefilling = seq.is_prefilling
        seq.num_computed_tokens += len(chunk.token_ids)
        if chunk.compute_logits:
            seq.logits_frontier = seq.num_computed_tokens
        if was_prefilling:
            self._advance_prompt(seq, chunk, now)
        decode_row = not was_prefilling and bool(chunk.token_ids)
        if chunk.sample:
            self.stats.decode_tokens += decode_row
            if decode_row:
                self.speculation.plain_round(seq)
            self.tokens.commit(seq, sampled[chunk.request_id], now, logprobs.get(chunk.request_id))
        elif not seq.is_prefilling and seq.num_output_tokens >= seq.max_new_tokens:
            self.active.finish(seq, FinishReason.LENGTH)  # max_new_tokens 0: prompt processing only
        return decode_row

    def _advance_prompt(self, seq: Sequence, chunk: ScheduledChunk, now: float) -> None:
        """A prompt chunk was computed: its captures, and the prompt's progress."""
        self.stats.prefill_tokens += len(chunk.token_ids)
        if seq.snapshot is not None:
            self.checkpoints.keep_snapshot(seq)
        self.checkpoints.capture_prompt_frontiers(seq)
        if not seq.is_prefilling:
            seq.timings.prompt_done = now
        elapsed_ms = (now - seq.timings.admitted) * 1000.0
        seq.unsent_progress = PromptProgress(
            seq.prompt_len, seq.num_cached_tokens, min(seq.num_computed_tokens, seq.prompt_len), elapsed_ms
        )

    def _land_after_finish(self, seq: Sequence, chunk: ScheduledChunk) -> None:
        """The step launched ahead for a request that finished meanwhile has landed: it
        computed the last committed token (and stored its logits); now release or keep."""
        seq.num_computed_tokens += len(chunk.token_ids)
        if chunk.compute_logits:
            seq.logits_frontier = seq.num_computed_tokens
        if seq.snapshot is not None:
            self.checkpoints.keep_snapshot(seq)
        self.checkpoints.release_or_capture_endpoint(seq)
