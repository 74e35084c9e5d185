"""DecodeGraphs: CUDA graphs per decode batch size, from token ids to sampled token ids.

A decode round of B requests (each with exactly one new token) is the same sequence of
kernels every step; only the values differ. At start-up we capture, for every B asked
for (the engine: 1..max_concurrency), embedding -> model forward -> logits over static
device buffers, and two sampling graphs reading those logits: the general sampler, and the
argmax alone for rounds whose rows are all greedy (the general one runs top-k over the
whole vocabulary, ~0.13 ms on a 248K vocabulary, even for greedy rows). A step then costs
two small host->device copies (ints, and floats unless every row is greedy without
penalties), a copy of any page-table row that changed and two replays; the runner reads
the sampled ids later (pending_step.py).

A row's input token is either given by the host or is the id the previous round sampled
for that row's request (rows chained by the scheduler's schedule_ahead): the sampling
graphs leave their ids in a device row of the int buffer, and the forward gathers each
row's token from the host's column or that row, so a round can be launched before the
previous round's ids have reached the host.

What the captured region may not do: read host copies of per-step values, sync with the
host (.item(), .tolist(), nonzero ...), or branch in Python on tensor values. The pieces
inside it satisfy that by contract:
  * paged attention: the Triton path reads query_start_loc / seq_lens / page_table on the
    device; its grid depends only on B (ForwardBatch.max_query_len is 1 at every replay);
  * Gated DeltaNet decode: recurrent_gated_delta_rule with query_lens (1,) * B and the
    conv step (in in_proj's GEMV epilogue, or causal_conv1d_update) index their state
    slots with device tensors;
  * sampling: the general no-penalty path (greedy rows by torch.where), or argmax when
    every row is greedy; rounds with presence/frequency penalties sample eagerly from the
    graph's logits, because their token lists change length every step, and so do rounds with
    an output constraint's token mask (built on the host each step).
The reference MoE (`fused_experts` lists the hit experts with .tolist()) cannot be
captured: models with MoE layers run eagerly until a fast fused_experts exists.

Warm-up runs before each capture execute for real: they write dummy KV at page 0, dummy
state into slots 0..B-1 and logits rows; capture happens before any request is admitted,
and those slots are reset afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ninfer.contract.sampling import TOP_K_CAP
from ninfer.engine.graph_capture import capture_graph
from ninfer.engine.graph_page_table import GraphPageTable
from ninfer.engine.sampler import Sampler, SamplingBatch
from ninfer.engine.scheduler import ScheduledChunk
from ninfer.engine.scheduler.chunks import penalized_in_flight
from ninfer.kernels.backend import fast_impl
from ninfer.models.causal_lm import CausalLM
from ninfer.models.forward_batch import ForwardBatch
from ninfer.models.kv_cache import KVCache
from ninfer.models.state_cache import StateCache

if TYPE_CHECKING:
    from ninfer.engine.speculative.speculator import Speculator

log = logging.getLogger("ninfer.engine")

# Rows of the int64 buffer [_NUM_INT_ROWS, max_batch]. The host fills the first
# _NUM_HOST_INTS (one contiguous host->device copy per step); the sampling graphs write
# _SAMPLED. _TOKEN_SOURCE is each row's flat index into the buffer: its own _TOKEN entry,
# or the _SAMPLED entry of the previous round's row for the same request. _ROPE_OFFSET is what
# a request with media adds to its rows' rotary positions (ScheduledChunk.rope_offset).
_TOKEN, _TOKEN_SOURCE, _POSITION, _ROPE_OFFSET, _SLOT, _STATE_SLOT, _TOP_K, _GREEDY, _SAMPLED = range(9)
_NUM_HOST_INTS = _SAMPLED
_NUM_INT_ROWS = _SAMPLED + 1
_NUM_FLOAT_PARAMS = 5  # SamplingBatch.row_floats columns, then TOP_K_CAP noise columns
# Host staging buffers per kind: a round may be launched while the previous one's copies
# are still queued, and the runner keeps at most two rounds in flight.
_NUM_STAGING = 2


def graph_blocker(model: CausalLM) -> str | None:
    """Why this model's decode step cannot be captured here, or None when it can."""
    probe = next(model.parameters())
    if not probe.is_cuda:
        return "CUDA graphs need a CUDA device"
    if fast_impl("ninfer.kernels.paged_attention", "paged_attention", probe) is None:
        # The reference loops over host copies of the lengths, frozen at capture.
        return "the fast paged attention is not in use (NINFER_KERNELS=ref or triton missing)"
    if model.config.is_moe and fast_impl("ninfer.kernels.moe", "fused_experts", probe) is None:
        return "the reference MoE syncs with the host (.tolist()); no fast fused_experts"
    return None


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        state_cache: StateCache | None,
        slot_logits: torch.Tensor,
        num_valid_tokens: int,
        batch_sizes: Sequence[int],
        max_pages_per_request: int,
        sampler: Sampler,
        speculator: Speculator | None = None,
    ):
        """speculator: with a speculative backend, a plain round between speculative ones also
        extends the drafter's context over its rows inside the graph (Speculator.extend_context,
        with the target's residual streams a DFlash drafter reads)."""
        self.model = model
        self.speculator = speculator
        self.kv_cache = kv_cache
        self.state_cache = state_cache
        self.slot_logits = slot_logits
        self.num_valid_tokens = num_valid_tokens
        self.batch_sizes = sorted(set(batch_sizes))
        max_batch = self.max_batch = self.batch_sizes[-1]
        self.max_pages = max_pages_per_request
        self.sampler = sampler
        self.device = slot_logits.device
        self.page_size = kv_cache.page_size
        self.mrope = model.config.mrope_section is not None
        if slot_logits.shape[0] < max_batch:
            raise ValueError("capture needs at least max_batch state slots")

        dev = self.device
        self.ints = torch.zeros(_NUM_INT_ROWS, max_batch, dtype=torch.int64, device=dev)
        self.floats = torch.ones(max_batch, _NUM_FLOAT_PARAMS + TOP_K_CAP, dtype=torch.float32, device=dev)
        self.pages = GraphPageTable(max_batch, max_pages_per_request, dev)
        self.page_table = self.pages.table
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)  # one token per row
        # Pinned staging, filled on the host each step and copied without blocking, used in
        # turn: a buffer is rewritten only after the round that read it has been read back.
        pin = dev.type == "cuda"
        self._ints_host = [
            torch.zeros(_NUM_HOST_INTS, max_batch, dtype=torch.int64, pin_memory=pin) for _ in range(_NUM_STAGING)
        ]
        self._floats_host = [
            torch.ones(max_batch, _NUM_FLOAT_PARAMS + TOP_K_CAP, dtype=torch.float32, pin_memory=pin)
            for _ in range(_NUM_STAGING)
        ]
        self._num_runs = 0
        # The pages last copied into each page-table row (a request's pages are fixed at
        # admission, so a row changes only when a different request lands on it).
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # the forward of each batch size
        self.sample_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (batch size, all greedy)
        self._outputs: dict[tuple, torch.Tensor] = {}  # each region's static output, by region key
        self.pool = None  # the graphs' memory pool, once captured

    # ---- capture -------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size into one memory pool (largest first sizes it); the step graphs
        capture into the same pool (`pool`) after these."""
        pool = self.pool = torch.cuda.graph_pool_handle()
        self._fill_dummy_inputs()
        for batch_size in reversed(self.batch_sizes):
            for key, region in self.regions(batch_size):
                # Kept: the sampling regions (captured next) read the forward's static logits.
                graph, self._outputs[key] = capture_graph(region, pool, self.device)
                self._store_graph(key, graph)
        self.discard_warmup_writes()

    def regions(self, batch_size: int) -> list[tuple[tuple, Callable[[], torch.Tensor]]]:
        """(key, function) of each captured region of one batch size, in replay order: the
        forward first (the sampling regions read its logits)."""
        return [
            (("forward", batch_size), lambda: self._forward(batch_size)),
            (("sample", batch_size, False), lambda: self._sample(batch_size, all_greedy=False)),
            (("sample", batch_size, True), lambda: self._sample(batch_size, all_greedy=True)),
        ]

    def _store_graph(self, key: tuple, graph) -> None:
        if key[0] == "forward":
            self.graphs[key[1]] = graph
        else:
            self.sample_graphs[key[1:]] = graph

    def _fill_dummy_inputs(self) -> None:
        """Valid inputs for the warm-up runs: token 0 at position 0 of page 0, greedy rows."""
        self.ints.zero_()
        rows = torch.arange(self.max_batch, device=self.device)
        self.ints[_TOKEN_SOURCE] = _TOKEN * self.max_batch + rows
        self.ints[_STATE_SLOT] = rows
        self.ints[_TOP_K] = 1
        self.ints[_GREEDY] = 1
        self.floats.fill_(1.0)
        self.floats[:, 2:_NUM_FLOAT_PARAMS] = 0.0  # min_p, presence, frequency
        self.page_table.zero_()

    def discard_warmup_writes(self) -> None:
        """Zero what the warm-up runs wrote (page 0, slots 0..max_batch-1): nothing may
        inherit it, also when a capture failed half-way."""
        torch.cuda.synchronize(self.device)
        self.kv_cache.k[:, 0].zero_()
        self.kv_cache.v[:, 0].zero_()
        for slot in range(self.max_batch):
            if self.state_cache is not None:
                self.state_cache.reset(slot)
            self.slot_logits[slot].zero_()
        self.pages.forget()

    def _forward(self, batch_size: int) -> torch.Tensor:
        """Captured: static buffers -> logits [B, V] fp32 (also written to the rows' slot logits)."""
        cols = self.ints[:, :batch_size]  # each field a contiguous row
        positions = cols[_POSITION]
        state_slots = cols[_STATE_SLOT]
        token_ids = self.ints.view(-1).index_select(0, cols[_TOKEN_SOURCE])
        batch = ForwardBatch(
            positions=(positions + cols[_ROPE_OFFSET]).unsqueeze(0).expand(3, -1) if self.mrope else positions,
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=(positions + 1).to(torch.int32),
            page_table=self.page_table[:batch_size],
            state_slots=state_slots,
            logits_indices=self.query_start_loc[:batch_size].long(),
            slot_mapping=cols[_SLOT],
            kv_cache=self.kv_cache,
            state_cache=self.state_cache,
            # Host copies fix the code path (decode) and the grid; the lengths in them are
            # stale at replay and nothing inside the graph may read them.
            query_lens_cpu=(1,) * batch_size,
            seq_lens_cpu=(1,) * batch_size,
        )
        if self.speculator is not None:
            self.speculator.request_aux_hidden(batch, batch_size)
        hidden = self.model(token_ids, batch)
        if self.speculator is not None:
            self.speculator.extend_context(token_ids, hidden, batch)
        logits = self.model.compute_logits(hidden).float()
        if self.num_valid_tokens < logits.shape[-1]:
            logits[:, self.num_valid_tokens :] = float("-inf")
        self.slot_logits.index_copy_(0, state_slots, logits)
        return logits

    def _sample(self, batch_size: int, all_greedy: bool) -> torch.Tensor:
        """Captured: the forward's logits -> sampled ids [B]; all_greedy: argmax only."""
        floats = self.floats[:batch_size]
        sampling = SamplingBatch(
            num_rows=batch_size,
            row_floats=floats[:, :_NUM_FLOAT_PARAMS],
            top_ks=self.ints[_TOP_K, :batch_size],
            is_greedy=self.ints[_GREEDY, :batch_size].bool(),
            noise=floats[:, _NUM_FLOAT_PARAMS:],
            penalty_rows=None,
            penalty_token_ids=None,
            all_greedy=all_greedy,  # else the general path: every mix of greedy and sampled rows
            any_greedy=True,
            has_penalties=False,
        )
        token_ids = self.sampler.sample(self._outputs[("forward", batch_size)], sampling)
        self.ints[_SAMPLED, :batch_size].copy_(token_ids)  # the next round's chained rows read them here
        return token_ids

    # ---- replay --------------------------------------------------------------------
    def can_run(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """A decode round of a captured size, each row one new token that needs its logits
        (a chained row's token from a previous row inside the sampled-ids row)."""
        if len(chunks) not in self.graphs:
            return False
        return all(
            len(c.token_ids) == 1
            and not c.speculative
            and c.compute_logits
            and len(c.page_ids) <= self.max_pages
            and (c.previous_row is None or c.previous_row < self.max_batch)
            for c in chunks
        )

    def run(
        self, chunks: Sequence[ScheduledChunk], previous_ids: torch.Tensor | None = None, sample: bool = True
    ) -> torch.Tensor | None:
        """Replay the graphs of len(chunks) rows; -> the sampled id of every row, on the device
        (a view of this object's buffer, valid until the next run).

        previous_ids: the previous launch's sampled ids by row, read by chunks with a
        previous_row (when that launch was not a replay here, they are copied in first).
        sample=False: the forward only (-> None); sample_eagerly() samples its logits later,
        once the rows' masks are known (ScheduledChunk.mask_follows_previous)."""
        batch_size = len(chunks)
        staging = self._num_runs % _NUM_STAGING
        self._num_runs += 1
        ints_host, floats_host = self._ints_host[staging], self._floats_host[staging]
        ints = ints_host.numpy()
        page_size, max_batch = self.page_size, self.max_batch
        sampled_row = self.ints[_SAMPLED]
        if any(c.previous_row is not None for c in chunks):
            if previous_ids is None:
                raise ValueError("a chunk is chained to the previous round's ids, but none were given")
            if previous_ids.data_ptr() != sampled_row.data_ptr():
                rows = min(len(previous_ids), self.max_batch)  # can_run: chained rows are below max_batch
                sampled_row[:rows].copy_(previous_ids[:rows])  # that round ran eagerly
        for row, chunk in enumerate(chunks):
            pos = chunk.num_computed_tokens
            if chunk.previous_row is None:
                ints[_TOKEN, row] = chunk.token_ids[0]
                ints[_TOKEN_SOURCE, row] = _TOKEN * max_batch + row
            else:
                ints[_TOKEN_SOURCE, row] = _SAMPLED * max_batch + chunk.previous_row
            ints[_POSITION, row] = pos
            ints[_ROPE_OFFSET, row] = chunk.rope_offset
            ints[_SLOT, row] = chunk.page_ids[pos // page_size] * page_size + pos % page_size
            ints[_STATE_SLOT, row] = chunk.state_slot
            self.pages.upload(row, chunk.page_ids)
        if not sample:
            self.ints[:_NUM_HOST_INTS].copy_(ints_host, non_blocking=True)
            self.graphs[batch_size].replay()
            return None
        params = [c.sampling for c in chunks]
        histories = [c.output_token_ids for c in chunks]
        generated = [c.num_generated for c in chunks]
        masks = [c.token_bitmask for c in chunks]
        masked = any(mask is not None for mask in masks)
        host = None
        if not masked and all(p.is_greedy and not p.presence_penalty and not p.frequency_penalty for p in params):
            # Argmax rows read nothing but the logits: skip packing the sampling rows on the
            # host (tens of microseconds of Python between two rounds, with the GPU idle).
            ints[_TOP_K, :batch_size] = 1
            ints[_GREEDY, :batch_size] = 1
        else:
            host = SamplingBatch.build(params, histories, device="cpu", num_generated=generated)
            ints[_TOP_K, :batch_size] = host.top_ks.numpy()
            ints[_GREEDY, :batch_size] = host.is_greedy.numpy()
            floats = floats_host.numpy()
            floats[:batch_size, :_NUM_FLOAT_PARAMS] = host.row_floats.numpy()
            floats[:batch_size, _NUM_FLOAT_PARAMS:] = host.noise.numpy()
            self.floats[:batch_size].copy_(floats_host[:batch_size], non_blocking=True)
        self.ints[:_NUM_HOST_INTS].copy_(ints_host, non_blocking=True)

        self.graphs[batch_size].replay()
        if host is not None and (host.has_penalties or masked):
            # Penalty token lists grow and masks change every step: sample these batches eagerly
            # from the graph's logits.
            return self.sample_eagerly(chunks)
        self.sample_graphs[(batch_size, host is None or host.all_greedy)].replay()
        return sampled_row[:batch_size]

    def sample_eagerly(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Sample the last replay's logits of len(chunks) rows with their masks and penalties;
        -> the sampled ids, as run() returns them."""
        batch_size = len(chunks)
        device_batch = SamplingBatch.build(
            [c.sampling for c in chunks],
            [c.output_token_ids for c in chunks],
            device=self.device,
            num_generated=[c.num_generated for c in chunks],
            token_bitmasks=[c.token_bitmask for c in chunks],
        )
        sampled_row = self.ints[_SAMPLED]
        # The sampled row still holds the previous round's ids: this round's sampling writes it below.
        device_batch = device_batch.counting_in_flight(*penalized_in_flight(list(chunks)), sampled_row)
        sampled_row[:batch_size].copy_(self.sampler.sample(self.logits(batch_size), device_batch))
        return sampled_row[:batch_size]

    def logits(self, batch_size: int) -> torch.Tensor:
        """The static logits of the last replay of graph batch_size (tests compare them)."""
        return self._outputs[("forward", batch_size)]
