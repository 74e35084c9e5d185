"""ModelRunner: turns a SchedulerStep into one model traversal and sampled tokens.

It owns the device side: the model, the KV page storage, the StateImage slots and, per
slot, the logits of the last computed row (a checkpoint keeps them so an exact
full-prompt hit samples without recomputing), plus the pinned host tier that checkpoint
StateImages spill to (host_states.py). Decode rounds replay a CUDA graph when
graphs were captured (cuda_graphs.py); prefill chunks, multi-token rows and steps that
sample stored logits run eagerly.

launch() enqueues a step and returns a PendingStep (its results come back through
StepReadback's pinned buffers); the host waits only when it reads the sampled ids. A chunk
with a previous_row computes the id the previously launched step sampled in that row, read on
the device, so the engine can launch decode round N+1 before round N's ids reach the host (at
most two launched steps unread); a round whose masks follow round N's tokens is sampled later
(DeferredSampling, sample_deferred). execute() is launch() then result().

An eager step packs its host-side metadata (page table, positions, lengths, slots, input ids,
sampling rows) into a pinned staging buffer and moves it with one non-blocking copy before
the forward and one before sampling: a copy from pageable memory would make the host wait
for the GPU's queue to drain, so no step could be enqueued ahead.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ninfer.engine.cache.host_kv import HostKV
from ninfer.engine.cache.host_states import HostStates
from ninfer.engine.cuda_graphs import DecodeGraphs
from ninfer.engine.host_detail import HostDetail
from ninfer.engine.media_embeddings import MediaEmbeddings
from ninfer.engine.deferred_sampling import DeferredSampling
from ninfer.engine.pending_step import PendingStep
from ninfer.engine.sampler import Sampler, SamplingBatch, pack_token_bitmasks
from ninfer.engine.scheduler import (
    CommitVerified,
    CopyPage,
    CopySlot,
    ResetSlot,
    RestorePages,
    RestoreSlot,
    ScheduledChunk,
    SchedulerStep,
    SpillPages,
    SpillSlot,
)
from ninfer.engine.scheduler.chunks import penalized_in_flight
from ninfer.engine.speculative.drafter_factory import make_drafter, quantize_drafter_fp8_
from ninfer.engine.speculative.proposal_head import ProposalHead
from ninfer.engine.speculative.speculator import Speculator
from ninfer.engine.runner_graphs import (
    build_step_graphs,
    capture_decode_graphs,
    capture_next_step_graph,
    step_graph_blocker,
)
from ninfer.engine.step_graphs import StepGraphs
from ninfer.engine.step_readback import MAX_TOP_LOGPROBS, MAX_UNREAD_STEPS, StepReadback
from ninfer.engine.step_layout import StepLayout
from ninfer.engine.verify_graphs import VerifyGraphs
from ninfer.models.causal_lm import CausalLM
from ninfer.models.dflash import DflashDraftModel
from ninfer.models.forward_batch import ForwardBatch, HostStaging
from ninfer.models.step_snapshots import StepSnapshots
from ninfer.models.verify_scratch import VerifyRows

if TYPE_CHECKING:
    from ninfer.parallel.group import RankGroup

log = logging.getLogger("ninfer.engine")

# Chunks with a checkpoint inside them that a step graph holds (each is a second request row).
MAX_GRAPH_SNAPSHOTS = 2


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_pages: int,
        page_size: int,
        num_state_slots: int,
        num_valid_tokens: int | None = None,
        kv_dtype: torch.dtype | None = None,
        cuda_graph_batch_sizes: Sequence[int] = (),
        max_context: int | None = None,
        num_host_state_slots: int = 0,
        num_host_kv_pages: int = 0,
        num_draft_tokens: int = 0,
        lm_head_draft: bool = False,
        draft_fp8: bool = False,
        draft_extra_token_ids: Sequence[int] = (),
        drafter=None,
        max_batch: int | None = None,
        spec_backend: str = "mtp",
        draft_model: DflashDraftModel | None = None,
        vision_tower: torch.nn.Module | None = None,
        kv_format: str = "bf16",
        step_graph_tokens: int = 0,
        step_graphs_while_idle: bool = False,
        ranks: RankGroup | None = None,
    ):
        """kv_format: the --kv-dtype of the model's KV (a DFlash drafter's stays plain).
        cuda_graph_batch_sizes: decode batch sizes to capture a CUDA graph for (on CUDA,
        when the model allows it; other sizes decode eagerly); max_context bounds the
        page-table width they are captured with (default: the whole KV pool).
        num_draft_tokens > 0: speculative decoding with spec_backend's drafter (the model's MTP
        head, or draft_model for dflash / dflash2; `drafter`: tests' stand-ins), proposals
        through the reduced-vocabulary head with lm_head_draft (draft_extra_token_ids: the added
        tokens it keeps); draft_fp8: the drafter's weights in FP8 (quantize_drafter_fp8_). max_batch: requests in a step at most (default: the largest graph
        batch, else the state slots). vision_tower: encodes the media of prompt steps (--vision).
        step_graph_tokens > 0: prompt and mixed steps of up to that many tokens replay CUDA graphs
        (step_graphs.py; on the CPU, tests run their padded forward uncaptured); captured at once,
        or with step_graphs_while_idle one by one through capture_next_graph (the engine loop's idle turns).
        ranks: the tensor-parallel group whose ranks run the same steps on their shards of `model`
        (ninfer/parallel/): each step's sampled ids are rank 0's on every rank."""
        self.model = model
        self.ranks = ranks
        param = next(model.parameters())
        self.device = param.device
        if step_graph_tokens and (blocker := step_graph_blocker(model, num_draft_tokens, spec_backend)) is not None:
            log.info("prompt and mixed steps run eagerly: %s", blocker)
            step_graph_tokens = 0
        # Step graphs pad with a state slot and a KV page that no request uses (beyond the pools).
        scratch = 1 if step_graph_tokens else 0
        self.kv_cache, self.state_cache = model.allocate_caches(
            num_pages + scratch, page_size, num_state_slots + scratch, kv_dtype, kv_format=kv_format
        )
        # A DFlash drafter's context KV lives in pages of its own shape under the same page ids.
        self.draft_kv_cache = draft_model.allocate_kv(num_pages, page_size, kv_dtype) if draft_model else None
        self.paged_caches = [c for c in (self.kv_cache, self.draft_kv_cache) if c is not None]
        vocab = model.config.vocab_size
        self.slot_logits = torch.zeros(num_state_slots + scratch, vocab, dtype=torch.float32, device=self.device)
        # Embedding rows past the tokenizer's ids are padding: never sample them.
        self.num_valid_tokens = min(num_valid_tokens or vocab, vocab)
        self.speculator: Speculator | None = None
        if num_draft_tokens:
            if drafter is None:
                if draft_fp8:
                    quantize_drafter_fp8_(model, draft_model)
                head = ProposalHead(
                    model.lm_head, self.num_valid_tokens, lm_head_draft, draft_extra_token_ids, fp8=draft_fp8
                )
                drafter = make_drafter(spec_backend, model, head, num_draft_tokens, draft_model, self.draft_kv_cache)
            max_batch = max_batch or max(cuda_graph_batch_sizes, default=num_state_slots)
            self.speculator = Speculator(
                model, self.state_cache, self.slot_logits, num_draft_tokens, max_batch, drafter, self.num_valid_tokens
            )
        extra = self.speculator.slot_tensors if self.speculator is not None else ()
        self.host_states = HostStates(self.state_cache, self.slot_logits, num_host_state_slots, extra)
        self.host_kvs = [HostKV(cache, num_host_kv_pages) for cache in self.paged_caches]
        self.host_detail = HostDetail()  # the engine core hands over its own (replica copies are timed here)
        self.mrope = model.config.mrope_section is not None
        self.media = MediaEmbeddings(vision_tower, self.device) if vision_tower is not None else None
        self.vision_seconds: dict[str, float] = {}  # tower time by request, until the engine takes it
        self.sampler = Sampler()
        # Every running request holds a state slot, so no step has more rows than slots.
        self.readback = StepReadback(self.device, num_state_slots, num_draft_tokens)
        # Eager steps' metadata, one buffer per unread step: a pinned buffer is refilled only after
        # the copies out of it have completed (the step that used it was read; else next_step waits).
        self._staging = HostStaging(self.device, num_turns=MAX_UNREAD_STEPS)
        # The log-probability rows' slots and masks, packed after the step's sampling (same turns).
        self._logprobs_staging = HostStaging(self.device, num_turns=MAX_UNREAD_STEPS)
        # The last launched step's sampled ids by chunk row (on the device), and its sampling rows.
        self._last_ids: torch.Tensor | None = None
        self._last_sampled_rows: frozenset[int] = frozenset()
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        self.step_graphs: StepGraphs | None = None
        max_context = max_context or num_pages * page_size
        caches = (model, self.kv_cache, self.state_cache, self.slot_logits, self.num_valid_tokens)
        if cuda_graph_batch_sizes:
            self.graphs, self.verify_graphs = capture_decode_graphs(
                *caches, sorted(set(cuda_graph_batch_sizes)), max_context, self.sampler, self.speculator
            )
        if step_graph_tokens:
            # A chunk with a checkpoint inside it is two requests of the forward; steps with more than
            # two such chunks are rare and run eagerly (every request row costs the rule a state copy).
            max_chunks = max_batch or max(cuda_graph_batch_sizes, default=num_state_slots)
            max_requests = max_chunks + min(max_chunks, MAX_GRAPH_SNAPSHOTS)
            # The scratch state slot and KV page sit just past the pools' own.
            self.step_graphs = build_step_graphs(*caches, self.graphs, self.device, step_graph_tokens,
                                                 max_requests, max_context, num_state_slots, num_pages,
                                                 while_idle=step_graphs_while_idle,
                                                 keep_hidden=self.speculator is not None)  # fmt: skip

    @property
    def has_graphs_to_capture(self) -> bool:
        return self.step_graphs is not None and self.step_graphs.captures and bool(self.step_graphs.pending)

    def capture_next_graph(self) -> None:
        """Capture one graph left to capture: only while no step is launched and unread."""
        capture_next_step_graph(self.step_graphs)

    def execute(self, step: SchedulerStep) -> dict[str, int]:
        """Run a step and wait for it: request id -> sampled token id."""
        return self.launch(step).result()

    @torch.inference_mode()
    def launch(self, step: SchedulerStep) -> PendingStep | DeferredSampling:
        """Enqueue a step; its sampled ids are read through the returned PendingStep. A step with
        rows whose masks follow the previous step's tokens is computed but not sampled: ->
        DeferredSampling, which sample_deferred() completes once the masks are known."""
        self.readback.check_room()
        for chunk in step.chunks:
            if chunk.previous_row is not None and (
                chunk.previous_row not in self._last_sampled_rows or len(chunk.token_ids) != 1
            ):
                raise ValueError(
                    f"{chunk.request_id}: chained to row {chunk.previous_row}, which the previous step did not sample"
                )
        self._apply_actions(step)
        verified = None
        if any(c.mask_follows_previous for c in step.chunks):
            on_graphs = self.graphs is not None and self.graphs.can_run(step.chunks)
            if on_graphs:
                self.graphs.run(step.chunks, self._last_ids, sample=False)
            else:
                self._staging.next_step()
                self._forward_eagerly(step.chunks, self._staging)
            return DeferredSampling(step, on_graphs)
        if self.verify_graphs is not None and self.verify_graphs.can_run(step.chunks):
            ids, sampled_rows, verified = None, [], self.verify_graphs.run(step.chunks)
        elif self.graphs is not None and self.graphs.can_run(step.chunks):
            ids = self.graphs.run(step.chunks, self._last_ids)
            sampled_rows = [row for row, c in enumerate(step.chunks) if c.sample]
        elif self.step_graphs is not None and self.step_graphs.can_run(step.chunks) and self._drafter_follows(step):
            self._staging.next_step()
            self.step_graphs.run(step.chunks, self._last_ids)
            if self.speculator is not None:
                # The MTP head's pass over the step's rows, eagerly, from the replay's hidden states.
                num_tokens = sum(len(c.token_ids) for c in step.chunks)
                self.speculator.extend(step.chunks, self.step_graphs.hidden[:num_tokens],
                                       self.step_graphs.token_ids[:num_tokens], self.kv_cache, self._staging)
            ids, sampled_rows = self._sample(step.chunks, self._staging)
        else:
            ids, sampled_rows, verified = self._run_eagerly(step.chunks)
        self._share_ids(ids)
        self._last_ids = ids
        self._last_sampled_rows = frozenset(sampled_rows)
        logprobs = self._logprobs(step.chunks, ids, sampled_rows)
        return self.readback.pending(step, ids, sampled_rows, verified, logprobs)

    @torch.inference_mode()
    def sample_deferred(self, deferred: DeferredSampling, masks: dict[int, np.ndarray | None]) -> PendingStep:
        """Sample a launched step whose rows waited for their masks (by row; rows not in `masks`
        keep theirs); -> its PendingStep, whose step carries the masks it was sampled with."""
        chunks = [
            dataclasses.replace(chunk, token_bitmask=masks.get(row)) if chunk.mask_follows_previous else chunk
            for row, chunk in enumerate(deferred.step.chunks)
        ]
        if deferred.on_graphs:
            ids = self.graphs.sample_eagerly(chunks)
            sampled_rows = [row for row, c in enumerate(chunks) if c.sample]
        else:
            ids, sampled_rows = self._sample(chunks, self._staging)
        self._share_ids(ids)
        self._last_ids = ids
        self._last_sampled_rows = frozenset(sampled_rows)
        logprobs = self._logprobs(chunks, ids, sampled_rows)
        return self.readback.pending(dataclasses.replace(deferred.step, chunks=chunks), ids, sampled_rows, None, logprobs)

    def _drafter_follows(self, step: SchedulerStep) -> bool:
        """Whether the drafter can follow this step's replay: rows in chunk order, none of them a
        verification row (without a drafter: always)."""
        return self.speculator is None or all(c.snapshot_slot is None and not c.speculative for c in step.chunks)

    def _share_ids(self, ids: torch.Tensor | None) -> None:
        """Tensor parallel: every rank takes rank 0's sampled ids, in place, before chained rows read
        them on the device. A sample is discrete: were the ranks' logits a bit apart (an all-reduce
        or a kernel that is not bit-identical across devices), one rank would fork the sequence,
        and one small broadcast a step rules that out instead of assuming bit-identical sampling."""
        if self.ranks is not None and ids is not None:
            self.ranks.broadcast_from_leader(ids)

    def _logprobs(
        self, chunks: list[ScheduledChunk], ids: torch.Tensor | None, sampled_rows: list[int]
    ) -> tuple[list[int], torch.Tensor] | None:
        """(rows, [rows, 1 + 2 * MAX_TOP_LOGPROBS] float64 on the device) for the sampled rows that
        ask for log probabilities: from the logits they were sampled from (the slot's, masked by
        the row's constraint), before penalties and temperature."""
        rows = [row for row in sampled_rows if chunks[row].logprobs is not None]
        if not rows:
            return None
        staging = self._logprobs_staging
        staging.next_step()
        slots = staging.add(np.array([chunks[row].state_slot for row in rows], dtype=np.int64))
        by_row = staging.add(np.array(rows, dtype=np.int64))
        packed = pack_token_bitmasks([chunks[row].token_bitmask for row in rows])
        bitmask = staging.add(packed) if packed is not None else None
        staging.flush()
        logits = self.slot_logits.index_select(0, slots)
        if bitmask is not None:
            logits = self.sampler.apply_token_bitmask(logits, bitmask)
        num_top = max(chunks[row].logprobs for row in rows)
        chosen, top_ids, top_values = self.sampler.token_logprobs(logits, ids.index_select(0, by_row), num_top)
        packed = torch.zeros(len(rows), 1 + 2 * MAX_TOP_LOGPROBS, dtype=torch.float64, device=self.device)
        packed[:, 0] = chosen
        packed[:, 1 : 1 + num_top] = top_values
        packed[:, 1 + MAX_TOP_LOGPROBS : 1 + MAX_TOP_LOGPROBS + num_top] = top_ids
        return rows, packed

    def abandon_launched(self) -> None:
        """A step failed: its launched steps will never be read, and no later step may chain to
        ids they sampled."""
        self.readback.abandon()
        self._last_ids = None
        self._last_sampled_rows = frozenset()

    def _run_eagerly(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor | None, list[int], torch.Tensor | None]:
        """-> (sampled ids by chunk row on the device, the rows that sample, the speculative
        rows' outcomes (Speculator.run) or None)."""
        staging = self._staging
        staging.next_step()
        verified = self._forward_eagerly(chunks, staging)
        ids, sampled_rows = self._sample(chunks, staging)
        return ids, sampled_rows, verified

    def _forward_eagerly(self, chunks: list[ScheduledChunk], staging: HostStaging) -> torch.Tensor | None:
        """The forward of the chunks that compute tokens (their logits into the slots); -> the
        speculative rows' outcomes (Speculator.run) or None."""
        computed = [c for c in chunks if c.token_ids]
        if not computed:
            return None
        num_verify = self.speculator.prepare(computed) if self.speculator is not None else 0
        hidden, batch, input_ids = self._forward(computed, staging, num_verify)
        if self.speculator is None:
            return None
        return self.speculator.run(computed, num_verify, hidden, batch, input_ids, staging)

    def _sample(self, chunks: list[ScheduledChunk], staging: HostStaging) -> tuple[torch.Tensor | None, list[int]]:
        """Sample the rows that ask for it from their slots' logits; -> (sampled ids by chunk row on the
        device, the rows that sample)."""
        sampled_rows = [row for row, c in enumerate(chunks) if c.sample and not c.speculative]
        if not sampled_rows:
            return None, []
        to_sample = [chunks[row] for row in sampled_rows]
        slots = staging.add(np.array([c.state_slot for c in to_sample], dtype=np.int64))
        # Where each sampled id goes in the step's by-row ids (None: every row samples).
        rows = None if len(sampled_rows) == len(chunks) else staging.add(np.array(sampled_rows, dtype=np.int64))
        batch = SamplingBatch.build(
            [c.sampling for c in to_sample],
            [c.output_token_ids for c in to_sample],
            device=self.device,
            num_generated=[c.num_generated for c in to_sample],
            staging=staging,
            token_bitmasks=[c.token_bitmask for c in to_sample],
        )
        staging.flush()
        batch = batch.counting_in_flight(*penalized_in_flight(to_sample), self._last_ids)
        token_ids = self.sampler.sample(self.slot_logits.index_select(0, slots), batch)
        if rows is None:
            return token_ids, sampled_rows
        by_row = torch.zeros(len(chunks), dtype=token_ids.dtype, device=self.device)
        return by_row.index_copy_(0, rows, token_ids), sampled_rows

    def _apply_actions(self, step: SchedulerStep) -> None:
        states = self.state_cache
        speculator = self.speculator
        commits: list[CommitVerified] = []  # consecutive commits run as one batch
        for action in step.before:
            if isinstance(action, CommitVerified):
                commits.append(action)
                continue
            if commits:
                speculator.commit(commits)
                commits = []
            if isinstance(action, ResetSlot):
                if states is not None:
                    states.reset(action.slot)
                self.slot_logits[action.slot].zero_()
                if speculator is not None:
                    speculator.reset_slot(action.slot)
            elif isinstance(action, CopySlot):
                if states is not None:
                    states.copy_slot(action.src, action.dst)
                self.slot_logits[action.dst].copy_(self.slot_logits[action.src])
                if speculator is not None:
                    speculator.copy_slot(action.src, action.dst)
            elif isinstance(action, CopyPage):
                for kv in self.paged_caches:
                    kv.k[:, action.dst].copy_(kv.k[:, action.src])
                    kv.v[:, action.dst].copy_(kv.v[:, action.src])
            elif isinstance(action, (SpillSlot, RestoreSlot, SpillPages, RestorePages)):
                with self.host_detail.timed("replica"):
                    self._move_replica(action)
        if commits:
            speculator.commit(commits)

    def _move_replica(self, action: SpillSlot | RestoreSlot | SpillPages | RestorePages) -> None:
        """A StateImage or KV pages to or from the pinned host tier."""
        if isinstance(action, SpillSlot):
            self.host_states.spill(action.device_slot, action.host_slot)
        elif isinstance(action, RestoreSlot):
            self.host_states.restore(action.host_slot, action.device_slot)
        elif isinstance(action, SpillPages):
            for host_kv in self.host_kvs:
                host_kv.spill(action.device_pages, action.host_pages)
        else:
            for host_kv in self.host_kvs:
                host_kv.restore(action.host_pages, action.device_pages)

    def _media_rows(
        self, chunks: list[ScheduledChunk], tokens: np.ndarray, staging: HostStaging, batch: ForwardBatch
    ) -> None:
        """Encode the step's media items not yet encoded and point the batch's media rows at their
        tower output; the identity ids in `tokens` become token 0 (its embedding is replaced)."""
        items = [item for c in chunks for item in c.media]
        if not items:
            return
        if self.media is None:
            raise RuntimeError("a request with media reached an engine without a vision tower")
        seconds = self.media.encode(items)
        if seconds:
            for request_id in {c.request_id for c in chunks if c.media}:
                self.vision_seconds[request_id] = self.vision_seconds.get(request_id, 0.0) + seconds
        gathered = self.media.gather(tokens)
        if gathered is None:
            return
        rows, embeds = gathered
        tokens[rows] = 0
        batch.media_rows = staging.add(rows.astype(np.int64))
        batch.media_embeds = embeds

    def _forward(
        self, chunks: list[ScheduledChunk], staging: HostStaging, num_verify: int = 0
    ) -> tuple[torch.Tensor, ForwardBatch, torch.Tensor]:
        """The step's forward; the first num_verify chunks are speculative verification rows
        (their logits are the Speculator's). -> (hidden [T, H], the batch, input ids [T]).

        A chunk with a snapshot runs as two requests on its slot: its rows before the frontier
        (their last row's logits go to the snapshot slot) and, last in the batch, the rest; the
        hidden rows then follow the batch's order, not the chunks' (no speculator runs then)."""
        layout = StepLayout.of(chunks)
        parts = layout.parts
        query_lens = layout.query_lens
        batch = ForwardBatch.stage(
            query_lens=query_lens,
            num_computed_tokens=[p.num_computed_tokens for p in parts],
            page_ids=[p.chunk.page_ids for p in parts],
            state_slots=[p.chunk.state_slot for p in parts],
            kv_cache=self.kv_cache,
            state_cache=self.state_cache,
            logits_indices=layout.logits_rows,
            staging=staging,
            mrope=self.mrope,
            rope_positions=[p.rope_positions for p in parts],
        )
        if layout.snapshotting:
            batch.snapshots = StepSnapshots(
                staging.add(np.array([c.state_slot for c in layout.snapshotting], dtype=np.int64)),
                staging.add(np.array([c.snapshot_slot for c in layout.snapshotting], dtype=np.int64)),
                layout.num_continuing,
            )
        tokens = layout.token_array()
        self._media_rows(chunks, tokens, staging, batch)
        input_ids = staging.add(tokens)
        logits_slots_device = staging.add(np.array(layout.logits_slots, dtype=np.int64))
        chained = None
        if layout.chained_offsets:
            chained = staging.add(np.array([layout.chained_offsets, layout.chained_rows], dtype=np.int64))
        staging.flush()
        if chained is not None:
            # The ids the previous step sampled, still on the device (these chunks hold a placeholder).
            input_ids.index_copy_(0, chained[0], self._last_ids.index_select(0, chained[1]))
        if num_verify:
            batch.verify = VerifyRows(num_verify, sum(query_lens[:num_verify]), self.speculator.scratch)
        if self.speculator is not None:
            self.speculator.request_aux_hidden(batch)
        hidden = self.model(input_ids, batch)
        if layout.logits_rows:
            logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices)).float()
            if self.num_valid_tokens < logits.shape[-1]:
                logits[:, self.num_valid_tokens :] = float("-inf")
            self.slot_logits.index_copy_(0, logits_slots_device, logits)
        return hidden, batch, input_ids

