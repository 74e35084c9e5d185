"""SpecPlan: a speculative step's inputs as host arrays; SpecInputs: the same on the device.

The scheduler's chunks become, per verification request (they lead the step): which of its
target rows score which position, its drafts and how many count, the acceptance uniforms,
its sampling rows (one per scored position, and one for its drafts) and the drafter's draws;
and per computed chunk, the rows of the drafter's own pass over the step (the MTP head's
input token and hidden-state source of each row, its positions and pages). A request with media
keeps its MRoPE positions there: its prompt rows' three axes, and after the prompt its index plus
its rope offset on every axis (Sequence.chunk_rope_positions). The eager path
stages these arrays with the step's other metadata; the verify graphs copy them into their
static buffers. Building them is host work only; using them never syncs with the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ninfer.contract.sampling import TOP_K_CAP
from ninfer.engine.sampler import SamplingBatch, exponential_noise
from ninfer.engine.scheduler import ScheduledChunk
from ninfer.engine.speculative.acceptance import DRAFT_DOMAIN, acceptance_uniforms
from ninfer.models.forward_batch import ForwardBatch, HostStaging
from ninfer.models.kv_cache import KVCache


@dataclass
class SpecPlan:
    num_draft_tokens: int
    num_verify: int
    chunks: list[ScheduledChunk]
    target_lengths: list[int]  # each chunk's rows in the target batch (a verification row: K+1)
    drafts: np.ndarray  # [B, K] (filler past num_drafts)
    num_drafts: np.ndarray  # [B]
    uniforms: np.ndarray  # [B, K] float32
    slots: np.ndarray  # [B]
    draft_noise: np.ndarray  # [B, 2K, C] float32: the drafter's draws for output positions gen+1 .. gen+2K
    position_sampling: SamplingBatch  # host tensors, B * (K+1) rows
    request_sampling: SamplingBatch  # host tensors, B rows
    mtp_lengths: list[int]  # the drafter's rows per chunk (a verification row: K+2)
    token_index: np.ndarray  # [T_mtp] target row whose token each drafter row reads (-1: none yet)
    hidden_index: np.ndarray  # [T_mtp] target row of the hidden it reads (>= T: the chunk's slot hidden)
    first_draft_rows: np.ndarray  # [B] drafter row after each verification row's pending token
    base: np.ndarray  # [B] position after the pending token
    limits: np.ndarray  # [B] reserved positions (drafts past them are clamped)
    rope_offsets: np.ndarray  # [B] what a request with media adds to a decoded token's index (rotary only)
    mtp_rope_positions: list[np.ndarray | None]  # per chunk: its drafter rows' [3, rows] MRoPE positions, or None

    @property
    def num_verify_rows(self) -> int:
        """Target rows of the verification chunks: K+1 each, position j of request b at b*(K+1)+j."""
        return self.num_verify * (self.num_draft_tokens + 1)


def plan_step(
    chunks: Sequence[ScheduledChunk], num_verify: int, num_draft_tokens: int, page_size: int,
    penalty_lists: bool = True,
) -> SpecPlan:
    """chunks: the step's computed chunks, its num_verify verification rows first (each the
    pending token and K draft places, Speculation.verification_chunk). penalty_lists False: the
    position rows carry no output tokens (VerifyGraphs counts them on the device)."""
    k = num_draft_tokens
    verifying = chunks[:num_verify]
    if any(len(c.token_ids) != k + 1 for c in verifying):
        raise ValueError(f"a verification row must hold the pending token and {k} draft places")
    target_lengths = [len(c.token_ids) for c in chunks]
    starts = np.cumsum([0, *target_lengths[:-1]]).astype(np.int64)

    drafts = np.array([c.token_ids[1:] for c in verifying], dtype=np.int64).reshape(num_verify, k)
    params, histories, generated = [], [], []
    for i, chunk in enumerate(verifying):
        drafted = chunk.num_draft_tokens
        for j in range(k + 1):
            params.append(chunk.sampling)
            # Penalties see the drafts before a position as output (only requests with penalties carry history).
            histories.append(list(chunk.output_token_ids) + drafts[i, : min(j, drafted)].tolist()
                             if penalty_lists and chunk.output_token_ids else [])
            generated.append(chunk.num_generated + j)
    request_params = [c.sampling for c in verifying]
    request_generated = [c.num_generated for c in verifying]
    draft_noise = np.ones((num_verify, 2 * k, TOP_K_CAP), dtype=np.float32)
    for i, p in enumerate(request_params):
        if not p.is_greedy:
            for offset in range(2 * k):
                draft_noise[i, offset] = exponential_noise(p.seed, request_generated[i] + 1 + offset, DRAFT_DOMAIN)

    mtp_lengths = [length + (1 if i < num_verify else 0) for i, length in enumerate(target_lengths)]
    num_target_rows = int(sum(target_lengths))
    token_index, hidden_index = [], []
    for i, (chunk, start, length) in enumerate(zip(chunks, starts, mtp_lengths)):
        rows = np.arange(length, dtype=np.int64)
        # Row r reads the target's token r (the extra row of a verification row: none yet)...
        token_index.append(np.where(rows < target_lengths[i], start + rows, -1))
        # ...and the target's hidden at r-1; row 0 the slot's, appended after the target rows.
        hidden_index.append(np.where(rows > 0, start + rows - 1, num_target_rows + i))
    mtp_starts = np.cumsum([0, *mtp_lengths[:-1]]).astype(np.int64)
    return SpecPlan(
        num_draft_tokens=k,
        num_verify=num_verify,
        chunks=list(chunks),
        target_lengths=target_lengths,
        drafts=drafts,
        num_drafts=np.array([c.num_draft_tokens for c in verifying], dtype=np.int64),
        uniforms=acceptance_uniforms(request_params, request_generated, k),
        slots=np.array([c.state_slot for c in verifying], dtype=np.int64),
        draft_noise=draft_noise,
        position_sampling=SamplingBatch.build(params, histories, "cpu", num_generated=generated),
        request_sampling=SamplingBatch.build(request_params, [[] for _ in verifying], "cpu",
                                             num_generated=request_generated),
        mtp_lengths=mtp_lengths,
        token_index=np.concatenate(token_index) if token_index else np.zeros(0, dtype=np.int64),
        hidden_index=np.concatenate(hidden_index) if hidden_index else np.zeros(0, dtype=np.int64),
        first_draft_rows=mtp_starts[:num_verify] + 1,
        base=np.array([c.num_computed_tokens + 1 for c in verifying], dtype=np.int64),
        limits=np.array([len(c.page_ids) * page_size for c in verifying], dtype=np.int64),
        rope_offsets=np.array([c.rope_offset for c in verifying], dtype=np.int64),
        mtp_rope_positions=[drafter_rope_positions(c, n) for c, n in zip(chunks, mtp_lengths)],
    )


def drafter_rope_positions(chunk: ScheduledChunk, num_rows: int) -> np.ndarray | None:
    """The MRoPE positions [3, num_rows] of the drafter's rows over `chunk` (None: text positions).
    A verification row's extra row decodes past the prompt: its index plus the rope offset."""
    explicit = chunk.rope_positions
    if explicit is None or explicit.shape[1] == num_rows:
        return explicit
    first = chunk.num_computed_tokens + explicit.shape[1]
    later = np.arange(first, chunk.num_computed_tokens + num_rows, dtype=np.int64) + chunk.rope_offset
    return np.concatenate([explicit, np.broadcast_to(later, (3, len(later)))], axis=1)


@dataclass
class SpecInputs:
    """A SpecPlan's tensors on the device (staged for one eager step, or a graph's static buffers)."""

    drafts: torch.Tensor
    num_drafts: torch.Tensor
    uniforms: torch.Tensor
    slots: torch.Tensor
    draft_noise: torch.Tensor
    position_sampling: SamplingBatch
    request_sampling: SamplingBatch
    mtp_batch: ForwardBatch
    mtp_slots: torch.Tensor  # [chunks] the slot of each chunk (its row-0 hidden)
    token_index: torch.Tensor
    hidden_index: torch.Tensor
    first_draft_rows: torch.Tensor
    base: torch.Tensor
    limits: torch.Tensor
    rope_offsets: torch.Tensor  # [B]: added to the drafter's decode positions for rotary (media)
    # [B * (K+1), V] fp32 output token counts per verification row (VerifyGraphs builds them on the
    # device); None: the eager path, whose position_sampling carries the token lists instead.
    penalty_counts: torch.Tensor | None = None


def stage_sampling(host: SamplingBatch, staging: HostStaging) -> SamplingBatch:
    """A host SamplingBatch's tensors packed into `staging` (valid on its device once flushed)."""
    penalty_rows = penalty_tokens = None
    if host.penalty_rows is not None:
        penalty_rows, penalty_tokens = staging.add(np.stack([host.penalty_rows.numpy(), host.penalty_token_ids.numpy()]))
    return SamplingBatch(
        num_rows=host.num_rows,
        row_floats=staging.add(host.row_floats.numpy()),
        top_ks=staging.add(host.top_ks.numpy()),
        is_greedy=staging.add(host.is_greedy.numpy()),
        noise=staging.add(host.noise.numpy()),
        penalty_rows=penalty_rows,
        penalty_token_ids=penalty_tokens,
        all_greedy=host.all_greedy,
        any_greedy=host.any_greedy,
        has_penalties=host.has_penalties,
    )


def stage_inputs(plan: SpecPlan, staging: HostStaging, kv_cache: KVCache, mrope: bool) -> SpecInputs:
    """The eager path: the plan packed into the step's staging (the caller flushes it)."""
    chunks = plan.chunks
    mtp_batch = ForwardBatch.stage(
        query_lens=plan.mtp_lengths,
        num_computed_tokens=[c.num_computed_tokens for c in chunks],
        page_ids=[c.page_ids for c in chunks],
        state_slots=[c.state_slot for c in chunks],
        kv_cache=kv_cache,
        state_cache=None,
        logits_indices=[],
        staging=staging,
        mrope=mrope,
        rope_positions=plan.mtp_rope_positions,
    )
    return SpecInputs(
        drafts=staging.add(plan.drafts),
        num_drafts=staging.add(plan.num_drafts),
        uniforms=staging.add(plan.uniforms),
        slots=staging.add(plan.slots),
        draft_noise=staging.add(plan.draft_noise),
        position_sampling=stage_sampling(plan.position_sampling, staging),
        request_sampling=stage_sampling(plan.request_sampling, staging),
        mtp_batch=mtp_batch,
        mtp_slots=staging.add(np.array([c.state_slot for c in chunks], dtype=np.int64)),
        token_index=staging.add(plan.token_index),
        hidden_index=staging.add(plan.hidden_index),
        first_draft_rows=staging.add(plan.first_draft_rows),
        base=staging.add(plan.base),
        limits=staging.add(plan.limits),
        rope_offsets=staging.add(plan.rope_offsets),
    )
