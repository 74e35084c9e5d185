"""Speculator: the device side of speculative decoding, owned by the runner.

A verification row computes [pending token, K draft places] in the step's varlen forward
(Gated DeltaNet scores them without writing the slot, see VerifyScratch). After the forward
the Speculator judges the drafts (acceptance.py), lets the drafter extend its context over
the step's chunks and propose the next drafts, and returns per row the accepted count, the
tokens and the new drafts in one device tensor. Nothing is committed yet: the scheduler
decides how many of those tokens the request keeps (a stop or the thinking budget may cut
a round short) and asks for that many rows with CommitVerified before the next forward,
which also makes those rows' logits and hidden state the slot's. So a request's state is
always exactly that of its committed tokens, as plain decoding leaves it.

Per slot it keeps the hidden state of the last computed position (the MTP head's input for
the next row; it travels with the StateImage in captures, spills and restores) and the
distribution each pending draft was drawn from (the rejection rule needs q).

The commit reads its slots, row starts and counts from a device buffer filled by one
non-blocking copy, and advances every Gated DeltaNet layer in two launches
(CausalLM.commit_verified); on CUDA it replays a graph per number of requests, so a
speculative round costs no host sync anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ninfer.contract.sampling import TOP_K_CAP
from ninfer.engine.graph_capture import capture_graph
from ninfer.engine.sampler import Sampler
from ninfer.engine.scheduler import CommitVerified, ScheduledChunk
from ninfer.engine.speculative.acceptance import DraftProposal, verify
from ninfer.engine.speculative.draft_round import DraftRound
from ninfer.engine.speculative.spec_plan import SpecInputs, plan_step, stage_inputs
from ninfer.models.causal_lm import CausalLM
from ninfer.models.forward_batch import ForwardBatch, HostStaging
from ninfer.models.kv_cache import KVCache
from ninfer.models.state_cache import StateCache

# Rows of the commit buffer [3, max_batch]: which slot, its first verification row, rows to keep.
_SLOT, _START, _COUNT = range(3)
# Pinned commit buffers used in turn: one may still be copying while the next is filled.
_NUM_COMMIT_STAGING = 2


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
        self.max_batch = max_batch
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
        # Every verification row is [pending token, K draft places]; the graphs capture these buffers.
        max_rows = self.max_rows = max_batch * (num_draft_tokens + 1)
        self.scratch = self.model.allocate_verify_scratch(max_rows, self.dtype)
        self.verify_hidden = torch.zeros(max_rows, hidden_size, dtype=self.dtype, device=self.device)
        self.verify_logits = torch.zeros(max_rows, vocab, dtype=torch.float32, device=self.device)
        self._aux_hidden: torch.Tensor | None = None  # request_aux_hidden's buffer for small steps
        self._commit_ints = torch.zeros(3, max_batch, dtype=torch.int64, device=self.device)
        pin = self.device.type == "cuda"
        self._commit_host = [torch.zeros(3, max_batch, dtype=torch.int64, pin_memory=pin)
                             for _ in range(_NUM_COMMIT_STAGING)]
        # Recorded after each copy out of a pinned buffer: it is refilled only once that copy is done.
        self._commit_copied = [torch.cuda.Event() for _ in range(_NUM_COMMIT_STAGING)] if pin else None
        self._num_commits = 0
        self._commit_graphs: dict[int, torch.cuda.CUDAGraph] = {}

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
        num_requests = len(actions)
        if num_requests > self.max_batch:
            raise ValueError(f"{num_requests} commits: at most {self.max_batch} verification rows a step")
        turn = self._num_commits % _NUM_COMMIT_STAGING
        self._num_commits += 1
        host = self._commit_host[turn]
        if self._commit_copied is not None:
            self._commit_copied[turn].synchronize()  # normally long done: a step was read since
        ints = host.numpy()
        for i, action in enumerate(actions):
            if not 1 <= action.num_rows <= self.num_draft_tokens + 1:
                raise ValueError(f"slot {action.slot}: {action.num_rows} rows to commit (1..{self.num_draft_tokens + 1})")
            ints[:, i] = (action.slot, action.row, action.num_rows)
        self._commit_ints[:, :num_requests].copy_(host[:, :num_requests], non_blocking=True)
        if self._commit_copied is not None:
            self._commit_copied[turn].record()
        graph = self._commit_graphs.get(num_requests)
        if graph is not None:
            graph.replay()
        else:
            self._commit_region(num_requests)

    def _commit_region(self, num_requests: int) -> None:
        """The commit of the first num_requests entries of the commit buffer (device reads only)."""
        slots, starts, counts = (self._commit_ints[field, :num_requests] for field in (_SLOT, _START, _COUNT))
        self.model.commit_verified(self.scratch, self.state_cache, slots, starts, counts, self.num_draft_tokens + 1)
        last = starts + counts - 1
        self.slot_hidden.index_copy_(0, slots, self.verify_hidden.index_select(0, last))
        self.slot_logits.index_copy_(0, slots, self.verify_logits.index_select(0, last))

    @torch.inference_mode()
    def capture_commit_graphs(self, pool) -> None:
        """One graph per number of requests (1..max_batch) into the runner's graph pool. The
        warm-up runs write nothing that matters: they commit zero rows of slot 0's logits and
        hidden from scratch row 0 (the runner resets capture slots afterwards)."""
        self._commit_ints.zero_()
        self._commit_ints[_COUNT] = 1
        for num_requests in range(self.max_batch, 0, -1):
            # Distinct slots: index_copy_ with repeated indices is not deterministic.
            self._commit_ints[_SLOT, :num_requests] = torch.arange(num_requests, device=self.device)
            self._commit_graphs[num_requests], _ = capture_graph(
                lambda n=num_requests: self._commit_region(n), pool, self.device
            )

    def extend_context(self, token_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> None:
        """A plain decode round (one row per request, no drafts): the drafter's context covers
        its rows, and each row's hidden state becomes its slot's, so drafting can resume at the
        next round. Device work only (the decode graphs capture it)."""
        self.drafter.extend_context(token_ids, hidden, batch, self.slot_hidden)
        self.slot_hidden.index_copy_(0, batch.state_slots, hidden)

    def commit_graph(self, num_requests: int) -> torch.cuda.CUDAGraph | None:
        return self._commit_graphs.get(num_requests)

    def discard_commit_graphs(self) -> None:
        """A capture failed part-way: commit eagerly."""
        self._commit_graphs.clear()

    def prepare(self, chunks: Sequence[ScheduledChunk]) -> int:
        """Before the forward: -> how many chunks are verification rows (they come first)."""
        num_verify = sum(1 for c in chunks if c.speculative)
        if any(c.speculative for c in chunks[num_verify:]):
            raise ValueError("speculative rows must come before the other chunks of a step")
        if num_verify > self.max_batch:
            raise ValueError(f"{num_verify} verification rows: the scratch holds {self.max_batch}")
        return num_verify

    def request_aux_hidden(self, batch: ForwardBatch, num_rows: int | None = None) -> None:
        """Before the forward: a buffer for the residual streams the drafter reads, if it reads any.
        Steps of up to max_rows rows (decode and verification rounds) use one persistent buffer,
        which the graphs capture; num_rows: the batch's rows when its host lengths are stale."""
        if not self.aux_layer_ids:
            return
        num_rows = batch.num_tokens if num_rows is None else num_rows
        batch.aux_layer_ids = self.aux_layer_ids
        if num_rows <= self.max_rows:
            if self._aux_hidden is None:
                self._aux_hidden = torch.zeros(
                    self.max_rows, len(self.aux_layer_ids), self.model.config.hidden_size,
                    dtype=self.dtype, device=self.device,
                )
            batch.aux_hidden = self._aux_hidden[:num_rows]
        else:
            batch.aux_hidden = torch.empty(
                num_rows, len(self.aux_layer_ids), self.model.config.hidden_size, dtype=self.dtype, device=self.device,
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
        return self._after_forward(chunks, num_verify, hidden, batch, input_ids, staging, batch.kv_cache)

    def extend(
        self, chunks: list[ScheduledChunk], hidden: torch.Tensor, input_ids: torch.Tensor, kv_cache: KVCache,
        staging: HostStaging,
    ) -> None:
        """After a step without verification rows whose forward ran elsewhere (a step graph's
        replay): the drafter's pass over its rows, and each chunk's last hidden state into its slot."""
        self._after_forward(chunks, 0, hidden, None, input_ids, staging, kv_cache)

    def _after_forward(
        self, chunks: list[ScheduledChunk], num_verify: int, hidden: torch.Tensor, batch: ForwardBatch | None,
        input_ids: torch.Tensor, staging: HostStaging, kv_cache: KVCache,
    ) -> torch.Tensor | None:
        plan = plan_step(chunks, num_verify, self.num_draft_tokens, kv_cache.page_size)
        inputs = stage_inputs(plan, staging, kv_cache, self.model.config.mrope_section is not None)
        staging.flush()
        num_accepted = tokens = None
        if num_verify:
            logits = self.score(hidden, plan.num_verify_rows)
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
        return self.verify_logits[:num_rows]

    def accept(self, logits: torch.Tensor, inputs: SpecInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (num_accepted [B], tokens [B, K+1]) (acceptance.verify on each verification row:
        row j of a request scores the token after its j-th draft place)."""
        sampling = inputs.position_sampling
        scores = logits
        if inputs.penalty_counts is not None:
            scores = Sampler.penalize_(logits.clone(), inputs.penalty_counts, sampling.row_floats)
        elif sampling.has_penalties:
            scores = Sampler.apply_penalties_(logits.clone(), sampling)
        proposal = DraftProposal(
            inputs.drafts, self.q_probs.index_select(0, inputs.slots), self.q_ids.index_select(0, inputs.slots)
        )
        return verify(scores, sampling, proposal, inputs.num_drafts, inputs.uniforms)

    def draft(
        self, hidden: torch.Tensor, batch: ForwardBatch | None, input_ids: torch.Tensor, inputs: SpecInputs,
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
