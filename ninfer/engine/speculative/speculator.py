"""Speculator: the device side of speculative decoding, owned by the runner.

A speculative row computes [pending tokens, drafts] in the step's varlen forward (Gated
DeltaNet scores them without writing the slot, see VerifyScratch). After the forward the
Speculator judges the drafts (acceptance.py), lets the drafter extend its context over the
step's chunks and propose the next drafts, and returns per row the accepted count, the
tokens and the new drafts in one device tensor. Nothing is committed yet: the scheduler
decides how many of those tokens the request keeps (a stop or the thinking budget may cut
a round short) and asks for that many rows with CommitVerified before the next forward,
which also makes those rows' logits and hidden state the slot's. So a request's state is
always exactly that of its committed tokens, as plain decoding leaves it.

Per slot it keeps the hidden state of the last computed position (the MTP head's input for
the next row; it travels with the StateImage in captures, spills and restores) and the
distribution each pending draft was drawn from (the rejection rule needs q).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ninfer.contract.sampling import TOP_K_CAP
from ninfer.engine.sampler import Sampler, SamplingBatch, exponential_noise
from ninfer.engine.scheduler import CommitVerified, ScheduledChunk
from ninfer.engine.speculative.acceptance import DRAFT_DOMAIN, DraftProposal, acceptance_uniforms, verify
from ninfer.engine.speculative.draft_round import DraftRound
from ninfer.models.causal_lm import CausalLM
from ninfer.models.forward_batch import ForwardBatch, HostStaging
from ninfer.models.state_cache import StateCache


class Speculator:
    def __init__(
        self,
        model: CausalLM,
        state_cache: StateCache | None,
        slot_logits: torch.Tensor,
        num_draft_tokens: int,
        max_batch: int,
        drafter,
        num_valid_tokens: int,
    ):
        """drafter: has draft(DraftRound, HostStaging) -> DraftProposal | None (MtpDrafter)."""
        self.model = model
        self.state_cache = state_cache
        self.slot_logits = slot_logits
        self.num_draft_tokens = num_draft_tokens
        self.drafter = drafter
        self.num_valid_tokens = num_valid_tokens
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype if param.is_floating_point() else torch.float32
        num_slots, vocab = slot_logits.shape
        hidden_size = model.config.hidden_size
        self.slot_hidden = torch.zeros(num_slots, hidden_size, dtype=self.dtype, device=self.device)
        self.q_probs = torch.zeros(num_slots, num_draft_tokens, TOP_K_CAP, dtype=torch.float32, device=self.device)
        self.q_ids = torch.zeros(num_slots, num_draft_tokens, TOP_K_CAP, dtype=torch.int64, device=self.device)
        self._allocate_rows(max_batch * (num_draft_tokens + 1))

    def _allocate_rows(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.scratch = self.model.allocate_verify_scratch(max_rows, self.dtype)
        hidden_size = self.model.config.hidden_size
        self.verify_hidden = torch.zeros(max_rows, hidden_size, dtype=self.dtype, device=self.device)
        self.verify_logits = torch.zeros(max_rows, self.slot_logits.shape[1], dtype=torch.float32, device=self.device)

    @property
    def slot_tensors(self) -> list[torch.Tensor]:
        """Per-slot tensors that belong to a StateImage beside the runner's logits."""
        return [self.slot_hidden]

    # ---- slot actions --------------------------------------------------------------
    def reset_slot(self, slot: int) -> None:
        self.slot_hidden[slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        self.slot_hidden[dst].copy_(self.slot_hidden[src])

    def commit(self, actions: Sequence[CommitVerified]) -> None:
        """Advance each slot by its accepted rows of the last speculative step."""
        rows = torch.cat([torch.arange(a.row, a.row + a.num_rows) for a in actions]).to(self.device)
        slots = torch.tensor([a.slot for a in actions], dtype=torch.int64, device=self.device)
        self.model.commit_verified(self.scratch, rows, self.state_cache, slots, tuple(a.num_rows for a in actions))
        last = torch.tensor([a.row + a.num_rows - 1 for a in actions], dtype=torch.int64, device=self.device)
        self.slot_hidden.index_copy_(0, slots, self.verify_hidden.index_select(0, last))
        self.slot_logits.index_copy_(0, slots, self.verify_logits.index_select(0, last))

    def prepare(self, chunks: Sequence[ScheduledChunk]) -> int:
        """Before the forward: room for this step's verification rows (rows with forced tokens
        are longer than 1 + K); -> how many chunks are verification rows (they come first)."""
        num_verify = sum(1 for c in chunks if c.speculative)
        if any(c.speculative for c in chunks[num_verify:]):
            raise ValueError("speculative rows must come before the other chunks of a step")
        num_rows = sum(len(c.token_ids) for c in chunks[:num_verify])
        if num_rows > self.max_rows:
            self._allocate_rows(num_rows)  # eager only: the previous step's rows were committed already
        return num_verify

    # ---- after the forward ---------------------------------------------------------
    def run(
        self,
        chunks: list[ScheduledChunk],
        num_verify: int,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        input_ids: torch.Tensor,
        staging: HostStaging,
    ) -> torch.Tensor | None:
        """-> [num_verify, 1 + (K+1) + K] int64 on the device: accepted count, tokens (accepted
        drafts then the target's next token), new drafts; None without verification rows."""
        k = self.num_draft_tokens
        starts = np.cumsum([0, *[len(c.token_ids) for c in chunks[:-1]]]).tolist()
        verifying = chunks[:num_verify]
        num_accepted = tokens = sampling = noise = None
        if num_verify:
            num_accepted, tokens, sampling, noise = self._verify(verifying, starts, hidden, staging)
        round = DraftRound(
            chunks=chunks, num_verify=num_verify, row_starts=starts, target_batch=batch, input_ids=input_ids,
            hidden=hidden, slot_hidden=self.slot_hidden, num_accepted=num_accepted, tokens=tokens,
            sampling=sampling, draft_noise=noise,
        )
        proposal = self.drafter.draft(round, staging)
        # The prompt chunks' last hidden states become their slots' (after the drafter read the old ones).
        others = chunks[num_verify:]
        if others:
            last_rows = torch.tensor([starts[num_verify + i] + len(c.token_ids) - 1 for i, c in enumerate(others)],
                                     dtype=torch.int64, device=self.device)
            slots = torch.tensor([c.state_slot for c in others], dtype=torch.int64, device=self.device)
            self.slot_hidden.index_copy_(0, slots, hidden.index_select(0, last_rows))
        if not num_verify:
            return None
        slots = torch.tensor([c.state_slot for c in verifying], dtype=torch.int64, device=self.device)
        self.q_probs.index_copy_(0, slots, proposal.probs)
        self.q_ids.index_copy_(0, slots, proposal.candidate_ids)
        return torch.cat((num_accepted[:, None], tokens, proposal.token_ids), dim=1)

    def _verify(self, chunks: list[ScheduledChunk], starts: list[int], hidden: torch.Tensor, staging: HostStaging):
        k = self.num_draft_tokens
        num_rows = sum(len(c.token_ids) for c in chunks)
        logits = self.model.compute_logits(hidden[:num_rows]).float()
        if self.num_valid_tokens < logits.shape[-1]:
            logits[:, self.num_valid_tokens :] = float("-inf")
        self.verify_logits[:num_rows].copy_(logits)
        self.verify_hidden[:num_rows].copy_(hidden[:num_rows])

        score_rows = np.zeros((len(chunks), k + 1), dtype=np.int64)
        drafts = np.zeros((len(chunks), k), dtype=np.int64)
        params, histories, generated = [], [], []
        for i, chunk in enumerate(chunks):
            drafted = chunk.num_draft_tokens
            pending = len(chunk.token_ids) - drafted
            score_rows[i] = starts[i] + pending - 1 + np.minimum(np.arange(k + 1), drafted)
            drafts[i, :drafted] = chunk.token_ids[pending:]
            for j in range(k + 1):
                params.append(chunk.sampling)
                # Penalties see the drafts before a position as output (only requests with penalties carry history).
                histories.append(list(chunk.output_token_ids) + drafts[i, :j].tolist() if chunk.output_token_ids else [])
                generated.append(chunk.num_generated + j)
        request_params = [c.sampling for c in chunks]
        request_generated = [c.num_generated for c in chunks]
        uniforms = acceptance_uniforms(request_params, request_generated, k)
        draft_noise = np.ones((len(chunks), 2 * k, TOP_K_CAP), dtype=np.float32)
        for i, p in enumerate(request_params):
            if not p.is_greedy:
                for offset in range(2 * k):
                    draft_noise[i, offset] = exponential_noise(p.seed, request_generated[i] + 1 + offset, DRAFT_DOMAIN)
        rows_device = staging.add(score_rows.reshape(-1))
        drafts_device = staging.add(drafts)
        num_drafts = staging.add(np.array([c.num_draft_tokens for c in chunks], dtype=np.int64))
        uniforms_device = staging.add(uniforms)
        noise_device = staging.add(draft_noise)
        position_sampling = SamplingBatch.build(params, histories, self.device, num_generated=generated, staging=staging)
        request_sampling = SamplingBatch.build(request_params, [[] for _ in chunks], self.device, staging=staging,
                                               num_generated=request_generated)
        staging.flush()

        scores = logits.index_select(0, rows_device)
        if position_sampling.has_penalties:
            scores = Sampler.apply_penalties_(scores, position_sampling)
        slots = torch.tensor([c.state_slot for c in chunks], dtype=torch.int64, device=self.device)
        proposal = DraftProposal(drafts_device, self.q_probs.index_select(0, slots), self.q_ids.index_select(0, slots))
        num_accepted, tokens = verify(scores, position_sampling, proposal, num_drafts, uniforms_device)
        return num_accepted, tokens, request_sampling, noise_device
