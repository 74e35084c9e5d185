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
from ninfer.engine.sampler import Sampler
from ninfer.engine.scheduler import CommitVerified, ScheduledChunk
from ninfer.engine.speculative.acceptance import DraftProposal, verify
from ninfer.engine.speculative.draft_round import DraftRound
from ninfer.engine.speculative.spec_plan import SpecInputs, plan_step, stage_inputs
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
        """drafter: has draft(DraftRound) -> DraftProposal | None (MtpDrafter, DflashDrafter); one
        that reads the target's residual streams after some layers names them in aux_layer_ids."""
        self.model = model
        self.state_cache = state_cache
        self.slot_logits = slot_logits
        self.num_draft_tokens = num_draft_tokens
        self.drafter = drafter
        self.aux_layer_ids: tuple[int, ...] = tuple(getattr(drafter, "aux_layer_ids", ()))
        self.num_valid_tokens = num_valid_tokens
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype if param.is_floating_point() else torch.float32
        num_slots, vocab = slot_logits.shape
        hidden_size = model.config.hidden_size
        self.slot_hidden = torch.zeros(num_slots, hidden_size, dtype=self.dtype, device=self.device)
        self.q_probs = torch.zeros(num_slots, num_draft_tokens, TOP_K_CAP, dtype=torch.float32, device=self.device)
        self.q_ids = torch.zeros(num_slots, num_draft_tokens, TOP_K_CAP, dtype=torch.int64, device=self.device)
        # Every verification row is [last token, up to K drafts]; the graphs capture these buffers.
        max_rows = self.max_rows = max_batch * (num_draft_tokens + 1)
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
        """Before the forward: -> how many chunks are verification rows (they come first)."""
        num_verify = sum(1 for c in chunks if c.speculative)
        if any(c.speculative for c in chunks[num_verify:]):
            raise ValueError("speculative rows must come before the other chunks of a step")
        if num_verify > self.max_rows // (self.num_draft_tokens + 1):
            raise ValueError(f"{num_verify} verification rows: the scratch holds {self.max_rows} rows")
        return num_verify

    def request_aux_hidden(self, batch: ForwardBatch) -> None:
        """Before the forward: a buffer for the residual streams the drafter reads, if it reads any."""
        if self.aux_layer_ids:
            batch.aux_layer_ids = self.aux_layer_ids
            batch.aux_hidden = torch.empty(
                batch.num_tokens, len(self.aux_layer_ids), self.model.config.hidden_size,
                dtype=self.dtype, device=self.device,
            )

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
        """The eager step: -> [num_verify, 1 + (K+1) + K] int64 on the device: accepted count,
        tokens (accepted drafts then the target's next token), new drafts; None without
        verification rows."""
        plan = plan_step(chunks, num_verify, self.num_draft_tokens, batch.kv_cache.page_size)
        inputs = stage_inputs(plan, staging, batch.kv_cache, self.model.config.mrope_section is not None)
        staging.flush()
        num_accepted = tokens = None
        if num_verify:
            logits = self.score(hidden, plan.num_target_rows_of(num_verify))
            num_accepted, tokens = self.accept(logits, inputs)
        out = self.draft(hidden, batch, input_ids, inputs, num_verify, num_accepted, tokens, chunks)
        others = chunks[num_verify:]
        if others:
            # The prompt chunks' last hidden states become their slots' (after the drafter read the old ones).
            ends = np.cumsum(plan.target_lengths)[num_verify:] - 1
            slots = torch.tensor([c.state_slot for c in others], dtype=torch.int64, device=self.device)
            self.slot_hidden.index_copy_(0, slots, hidden.index_select(0, torch.from_numpy(ends).to(self.device)))
        return out

    def score(self, hidden: torch.Tensor, num_rows: int) -> torch.Tensor:
        """The verification rows' logits [num_rows, V] fp32, kept with their hidden states for the commit."""
        logits = self.model.compute_logits(hidden[:num_rows]).float()
        if self.num_valid_tokens < logits.shape[-1]:
            logits[:, self.num_valid_tokens :] = float("-inf")
        self.verify_logits[:num_rows].copy_(logits)
        self.verify_hidden[:num_rows].copy_(hidden[:num_rows])
        return logits

    def accept(self, logits: torch.Tensor, inputs: SpecInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (num_accepted [B], tokens [B, K+1]) (acceptance.verify on each scored position)."""
        sampling = inputs.position_sampling
        scores = logits.index_select(0, inputs.score_rows)
        if sampling.has_penalties:
            scores = Sampler.apply_penalties_(scores, sampling)
        proposal = DraftProposal(
            inputs.drafts, self.q_probs.index_select(0, inputs.slots), self.q_ids.index_select(0, inputs.slots)
        )
        return verify(scores, sampling, proposal, inputs.num_drafts, inputs.uniforms)

    def draft(
        self, hidden: torch.Tensor, batch: ForwardBatch, input_ids: torch.Tensor, inputs: SpecInputs,
        num_verify: int, num_accepted: torch.Tensor | None, tokens: torch.Tensor | None,
        chunks: list[ScheduledChunk] | None = None,
    ) -> torch.Tensor | None:
        """Run the drafter and keep the new drafts' distributions per slot; -> the step's outcome rows."""
        round = DraftRound(
            num_verify=num_verify, target_batch=batch, input_ids=input_ids, hidden=hidden,
            slot_hidden=self.slot_hidden, num_accepted=num_accepted, tokens=tokens, inputs=inputs, chunks=chunks,
        )
        proposal = self.drafter.draft(round)
        if not num_verify:
            return None
        self.q_probs.index_copy_(0, inputs.slots, proposal.probs)
        self.q_ids.index_copy_(0, inputs.slots, proposal.candidate_ids)
        return torch.cat((num_accepted[:, None], tokens, proposal.token_ids), dim=1)
