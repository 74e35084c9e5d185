"""Speculation: which decode rows verify drafts, and the commit of a verified round.

With a speculative backend, a step drafts when any of its decode-ready requests does
(DraftPolicy, or every round without adaptive drafts). A drafting step's decode rows with
exactly one pending token become verification rows: the pending token and K draft places, the
shape the verify graphs replay; they lead the step. A verified round's tokens are committed one
by one, and the runner is asked to advance the state slot by exactly the rows kept
(CommitVerified).
"""

from __future__ import annotations

from ninfer.engine.scheduler.action_queue import ActionQueue
from ninfer.engine.scheduler.chunks import decode_chunk, plain_chunk
from ninfer.engine.scheduler.limits import SchedulerLimits
from ninfer.engine.scheduler.stats import SchedulerStats
from ninfer.engine.scheduler.step import CommitVerified, ScheduledChunk, SchedulerStep, VerifyOutcome
from ninfer.engine.scheduler.token_commit import TokenCommit
from ninfer.engine.sequence import Sequence


def verify_rows(step: SchedulerStep) -> dict[str, int]:
    """Each speculative chunk's first row among the step's verification rows (they lead the
    step, in order), by request id."""
    rows: dict[str, int] = {}
    row = 0
    for chunk in step.chunks:
        if chunk.speculative:
            rows[chunk.request_id] = row
            row += len(chunk.token_ids)
    return rows


class Speculation:
    def __init__(self, limits: SchedulerLimits, stats: SchedulerStats, actions: ActionQueue, tokens: TokenCommit):
        """actions: where a verified round's CommitVerified goes; tokens: commits its tokens."""
        self.limits = limits
        self.stats = stats
        self.actions = actions
        self.tokens = tokens

    # ---- planning ------------------------------------------------------------------
    def drafting(self, decode_ready: list[Sequence], ahead: bool = False) -> bool:
        """Whether this step's decode rows verify drafts: with a backend loaded, when any of them
        drafts (DraftPolicy; every round without adaptive drafts). ahead: the round after the
        one in flight, which counts as one more plain round for each policy."""
        if not self.limits.num_draft_tokens:
            return False
        policies = [s.draft_policy for s in decode_ready if not s.decodes_plainly]
        if not policies:
            return False
        if any(p is None for p in policies):
            return True
        return any(p.wants_drafts(rounds_ahead=int(ahead)) for p in policies)

    def decode_rows(self, decode_ready: list[Sequence]) -> list[ScheduledChunk]:
        """The step's decode rows; verification rows first, as the runner verifies them ahead
        of the rest of the forward."""
        drafting = self.drafting(decode_ready)
        ordered = sorted(decode_ready, key=lambda s: not self._speculates(s, drafting))
        return [self.verification_chunk(s) if self._speculates(s, drafting) else decode_chunk(s) for s in ordered]

    @staticmethod
    def _speculates(seq: Sequence, drafting: bool) -> bool:
        """A decode row of a drafting step becomes a speculative round when exactly one token is
        to compute. A full-prompt hit samples its stored logits first; forced thinking-close
        tokens are computed as a plain row (the drafter extends its context over it and drafts
        from the next round on), so every verification row has the same shape."""
        return drafting and seq.num_pending_tokens == 1 and not seq.decodes_plainly

    def verification_chunk(self, seq: Sequence) -> ScheduledChunk:
        """The pending token and K draft places: as many of the request's drafts as its output
        limit can take (a round commits at most drafts + 1 tokens), then filler that is never
        accepted. Every verification row has K + 1 tokens, the shape the verify graphs replay; a
        request with media keeps its rows' MRoPE positions (index + rope offset on every axis)."""
        pending = seq.token_ids[seq.num_computed_tokens :]
        room = seq.max_new_tokens - seq.num_output_tokens - 1
        drafts = seq.draft_token_ids[: max(0, min(room, self.limits.num_draft_tokens))]
        filler = pending[-1:] * (self.limits.num_draft_tokens - len(drafts))
        chunk = plain_chunk(seq, pending + drafts + filler, compute_logits=True, sample=True)
        return ScheduledChunk(
            request_id=chunk.request_id,
            token_ids=chunk.token_ids,
            num_computed_tokens=chunk.num_computed_tokens,
            page_ids=chunk.page_ids,
            state_slot=chunk.state_slot,
            compute_logits=True,
            sample=chunk.sample,
            sampling=chunk.sampling,
            num_generated=chunk.num_generated,
            output_token_ids=chunk.output_token_ids,
            speculative=True,
            num_draft_tokens=len(drafts),
            rope_positions=chunk.rope_positions,
            rope_offset=chunk.rope_offset,
        )

    # ---- commit --------------------------------------------------------------------
    def plain_round(self, seq: Sequence) -> None:
        """seq's decode row of this step sampled one token without drafts (plain or forced)."""
        if seq.speculative is None:
            return
        seq.speculative.fallback_steps += 1
        seq.draft_token_ids = []  # proposals followed the token before this one
        if seq.draft_policy is not None:
            seq.draft_policy.plain_round()

    def commit(self, seq: Sequence, chunk: ScheduledChunk, outcome: VerifyOutcome, row: int, now: float) -> None:
        """Commit a speculative round's tokens, then ask the runner to advance the state by
        exactly the rows whose tokens were kept (from `row`, the chunk's first verification
        row). Drafts proposed after the last token are kept while the round committed all of
        its tokens and nothing else is pending."""
        committed = self._commit_tokens(seq, chunk, outcome, now)
        num_accepted = len(outcome.tokens) - 1
        num_rows = seq.num_computed_tokens - chunk.num_computed_tokens
        self.actions.add(CommitVerified(chunk.state_slot, row, num_rows))
        keep_drafts = not seq.is_finished and committed == len(outcome.tokens) and seq.num_pending_tokens == 1
        seq.draft_token_ids = list(outcome.drafts) if keep_drafts else []
        self.stats.decode_tokens += committed
        self.stats.drafted_tokens += chunk.num_draft_tokens
        self.stats.accepted_tokens += num_accepted
        if seq.draft_policy is not None:
            seq.draft_policy.observe(chunk.num_draft_tokens, num_accepted, seq.num_computed_tokens)
        self._count(seq, chunk.num_draft_tokens, num_accepted)

    def _commit_tokens(self, seq: Sequence, chunk: ScheduledChunk, outcome: VerifyOutcome, now: float) -> int:
        """Commit the round's tokens one by one (stop strings, limits and the thinking budget
        apply to each); returns how many were committed. The last committed token is computed
        when it was a draft, unless the request finished on it: a finished request leaves the
        endpoint plain decoding leaves (which never computes a request's last token), so the
        next turn reuses the same prefix: a stop string's last token never comes back in the
        client's next prompt, and a state past it would match nothing there."""
        num_pending = 1  # _speculates: exactly one pending token
        num_accepted = len(outcome.tokens) - 1
        start = chunk.num_computed_tokens
        committed = 0
        for token in outcome.tokens:
            # Set before the commit, which captures the endpoint when this token finishes the
            # request: the pending rows and the drafts before this token.
            seq.num_computed_tokens = seq.logits_frontier = start + num_pending + min(committed, num_accepted)
            length = len(seq.token_ids)
            self.tokens.commit(seq, token, now)
            committed += 1
            if seq.is_finished:
                break
            # Kept and the request goes on: this token's row (a draft's) is computed as well.
            seq.num_computed_tokens = seq.logits_frontier = start + num_pending + min(committed, num_accepted)
            if len(seq.token_ids) > length + 1:
                break  # the thinking budget appended forced tokens after it
        return committed

    @staticmethod
    def _count(seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """The request's speculative counters (its final output reports them)."""
        counters = seq.speculative
        if counters is None:
            return
        if not num_drafted:
            counters.fallback_steps += 1
            return
        counters.rounds += 1
        counters.drafted_tokens += num_drafted
        counters.accepted_tokens += num_accepted
        for position in range(num_accepted):
            counters.accepted_per_position[position] += 1
