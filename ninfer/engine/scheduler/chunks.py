"""Chunks: the ScheduledChunks a step carries for a sequence.

A decode row computes the pending tokens and samples; a chained row (decode overlap) computes
the token the step launched before it samples, still unknown on the host; a prompt chunk
computes up to a token budget of the prompt and ends at a capture frontier, or goes on past the
first one it can snapshot inside the step (PromptChunks).
"""

from __future__ import annotations

import dataclasses

from ninfer.contract.sampling import SamplingParams
from ninfer.engine.scheduler.checkpoints import Checkpoints, Snapshot
from ninfer.engine.scheduler.limits import SchedulerLimits
from ninfer.engine.scheduler.step import PENDING_TOKEN, ScheduledChunk
from ninfer.engine.sequence import Sequence


def has_penalties(sampling: SamplingParams) -> bool:
    return sampling.presence_penalty != 0.0 or sampling.frequency_penalty != 0.0


def penalized_in_flight(chunks: list[ScheduledChunk]) -> tuple[list[int], list[int]]:
    """The rows of `chunks` whose penalties must also count a token still in flight (chained,
    with penalties), and the row of the previous step that sampled each one."""
    rows = [row for row, c in enumerate(chunks) if c.previous_row is not None and has_penalties(c.sampling)]
    return rows, [chunks[row].previous_row for row in rows]


def media_fields(seq: Sequence, start: int, num_tokens: int) -> dict:
    """ScheduledChunk's media fields for tokens [start, start + num_tokens) of seq."""
    if not seq.has_media or not num_tokens:
        return {}  # no media, or nothing to compute (the slot's stored logits are sampled)
    end = start + num_tokens
    return {
        "rope_positions": seq.chunk_rope_positions(start, end),
        "rope_offset": seq.rope_offset,
        "media": tuple(
            item for item in seq.request.media
            if any(span_start < end and start < span_end for span_start, span_end in item.token_spans())
        ),
    }


def plain_chunk(seq: Sequence, token_ids: list[int], compute_logits: bool, sample: bool) -> ScheduledChunk:
    """token_ids of seq from its computed frontier; sampling only while output is left."""
    sample = sample and seq.num_output_tokens < seq.max_new_tokens
    constraint = seq.constraint
    return ScheduledChunk(
        token_bitmask=constraint.next_token_bitmask() if sample and constraint is not None else None,
        logprobs=seq.request.top_logprobs,
        **media_fields(seq, seq.num_computed_tokens, len(token_ids)),
        request_id=seq.request_id,
        token_ids=token_ids,
        num_computed_tokens=seq.num_computed_tokens,
        page_ids=seq.pages,
        state_slot=seq.state_slot,
        compute_logits=compute_logits,
        sample=sample,
        sampling=seq.sampling,
        num_generated=seq.num_output_tokens - seq.num_forced_tokens,
        # Copying the history costs O(output) per step; only penalties read it.
        output_token_ids=seq.token_ids[seq.prompt_len :] if has_penalties(seq.sampling) else [],
    )


def decode_chunk(seq: Sequence) -> ScheduledChunk:
    """A decode row: the pending tokens (the last sampled one, or forced tokens before it), or
    none for a full-prompt hit, which samples the slot's stored logits."""
    return plain_chunk(seq, seq.token_ids[seq.num_computed_tokens :], compute_logits=True, sample=True)


def chained_chunk(seq: Sequence, previous_row: int) -> ScheduledChunk:
    """The row after one in flight: it computes what row `previous_row` of the launched step
    samples for seq, so everything is counted one token ahead."""
    return ScheduledChunk(
        request_id=seq.request_id,
        token_ids=[PENDING_TOKEN],
        num_computed_tokens=seq.num_computed_tokens + 1,
        page_ids=seq.pages,
        state_slot=seq.state_slot,
        compute_logits=True,
        sample=True,
        sampling=seq.sampling,
        num_generated=seq.num_output_tokens - seq.num_forced_tokens + 1,
        # The committed output; the token in flight (this row's input) is counted on the device.
        output_token_ids=seq.token_ids[seq.prompt_len :] if has_penalties(seq.sampling) else [],
        previous_row=previous_row,
        mask_follows_previous=seq.constraint is not None,
        logprobs=seq.request.top_logprobs,
        **media_fields(seq, seq.num_computed_tokens + 1, 1),
    )


# Beside decode rows, a checkpoint inside a chunk costs the step a second pass of the Gated
# DeltaNet conv and rule over its bucket, which every decoding stream waits for (a 27B burst's
# prompt-ending steps took 4-12 ms more on an H100); ending the chunk at the frontier instead
# moves its remaining tokens to the next step, which costs only what they leave unfilled. So
# there the snapshot stays inside only when at least this many tokens come after the frontier.
MIN_TOKENS_AFTER_SNAPSHOT_BESIDE_DECODE = 128


class PromptChunks:
    def __init__(self, limits: SchedulerLimits, checkpoints: Checkpoints):
        """checkpoints: where a capture inside a chunk reserves its device slot."""
        self.limits = limits
        self.checkpoints = checkpoints

    def chunk(self, seq: Sequence, max_tokens: int, beside_decode: bool = False) -> ScheduledChunk:
        """At most max_tokens of seq's prompt. The first capture frontier inside is snapshotted
        within the step where it can be, so the chunk goes on past it (a chat's generation
        prompt after its turn closure costs no step of its own); the next one ends the chunk.
        beside_decode: the step carries decode rows; a frontier with fewer than
        MIN_TOKENS_AFTER_SNAPSHOT_BESIDE_DECODE of the chunk's tokens after it ends the chunk."""
        start = seq.num_computed_tokens
        end = min(seq.prompt_len, start + max_tokens)
        snapshot_at, snapshot_slot = 0, None
        for frontier, path in seq.capture_frontiers:
            if not start < frontier < end:
                continue
            worth_a_pass = not beside_decode or end - frontier >= MIN_TOKENS_AFTER_SNAPSHOT_BESIDE_DECODE
            if snapshot_slot is None and worth_a_pass and self._snapshots_in_step(seq):
                reserved = self.checkpoints.reserve_snapshot(seq, frontier, path)
                if reserved is Snapshot.NOT_NEEDED:
                    continue
                if reserved is not Snapshot.NO_SLOT:
                    snapshot_at, snapshot_slot = frontier, reserved
                    continue
            end = frontier
            break
        last = end == seq.prompt_len
        captures_here = any(f == end for f, _ in seq.capture_frontiers)
        chunk = plain_chunk(seq, seq.token_ids[start:end], compute_logits=last or captures_here, sample=last)
        if snapshot_slot is None:
            return chunk
        return dataclasses.replace(chunk, snapshot_tokens=snapshot_at - start, snapshot_slot=snapshot_slot)

    def _snapshots_in_step(self, seq: Sequence) -> bool:
        # Speculative steps carry drafter state per slot, and media rows are placed by token order:
        # both keep the plain path (a step that ends at the frontier, then a copy).
        return self.limits.prefix_reuse and self.limits.spec_backend is None and not seq.has_media
