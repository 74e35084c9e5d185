"""VerifyGraphs: CUDA graphs for speculative rounds, per batch size.

A speculative round of B requests, each verification row the pending token and K draft
places (Speculation.verification_chunk), is the same sequence of kernels every round; only
the values differ. At start-up we capture, for every B asked for (the engine:
1..max_concurrency):
  * the forward: embedding -> model over the B * (K+1) rows (Gated DeltaNet scores them
    without writing the slots and leaves its inputs in the verify scratch) -> every row's
    logits and hidden state (Speculator.score);
  * the judge-and-draft region, twice (every row greedy without penalties, or the general
    rule): acceptance, the drafter's pass over the rows and its K proposals per request, and
    the outcome rows [B, 1 + (K+1) + K] (Speculator.accept / draft). The general region
    applies presence and frequency penalties from a count table it builds on the device: the
    penalized requests' output tokens arrive as flat indices in a fixed buffer (a prefix of it
    copied per round, the rest masked by a count) and each row adds the drafts before it.
The previous round's accepted rows are committed before, from the Speculator's own graphs.
A round then costs one host->device copy of the plan (a pinned mirror of every input, in
one buffer), a copy of any page-table row that changed and two replays; the runner reads
the outcome later, as for an eager step. A request with media decodes at index + rope offset on
every MRoPE axis: the host writes those rotary positions into the position buffers, and the
offset for the drafter's own rows, so media changes only the values the host fills.

The captured regions obey DecodeGraphs' rules (no host reads of per-step values, no host
syncs, no Python branches on tensor values): the paged attention kernel reads the lengths
and page table on the device, its grid fixed by B and K+1 queries per request; the Gated
DeltaNet verification path runs on B equal lengths; acceptance and the MTP drafter are
fixed-shape tensor work (mtp_drafter.py). Steps that mix verification rows with prompt chunks
or plain rows, and rounds whose penalized output tokens overflow the buffer, run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from ninfer.contract.sampling import TOP_K_CAP
from ninfer.engine.graph_capture import capture_graph
from ninfer.engine.graph_page_table import GraphPageTable
from ninfer.engine.sampler import SamplingBatch
from ninfer.engine.scheduler import ScheduledChunk
from ninfer.engine.scheduler.chunks import has_penalties
from ninfer.engine.speculative.spec_plan import SpecInputs, plan_step
from ninfer.engine.speculative.speculator import Speculator
from ninfer.engine.static_inputs import StaticInputs
from ninfer.engine.verify_penalties import VerifyPenalties
from ninfer.models.causal_lm import CausalLM
from ninfer.models.forward_batch import ForwardBatch
from ninfer.models.kv_cache import KVCache
from ninfer.models.state_cache import StateCache
from ninfer.models.verify_scratch import VerifyRows

log = logging.getLogger("ninfer.engine")

_NUM_FLOAT_PARAMS = 5  # SamplingBatch.row_floats columns


class VerifyGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        state_cache: StateCache | None,
        speculator: Speculator,
        batch_sizes: Sequence[int],
        max_pages_per_request: int,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.state_cache = state_cache
        self.speculator = speculator
        self.batch_sizes = sorted(set(batch_sizes))
        max_batch = self.max_batch = self.batch_sizes[-1]
        if max_batch > speculator.max_batch:
            raise ValueError(f"graph batch {max_batch} exceeds the speculator's {speculator.max_batch} rows")
        self.max_pages = max_pages_per_request
        self.device = speculator.device
        self.page_size = kv_cache.page_size
        self.mrope = model.config.mrope_section is not None
        k = self.num_draft_tokens = speculator.num_draft_tokens
        rows, mtp_rows = max_batch * (k + 1), max_batch * (k + 2)
        i64, i32, f32 = torch.int64, torch.int32, torch.float32
        self.inputs = StaticInputs(
            {
                "token_ids": ((rows,), i64),
                # Rotary positions: a request with media adds its rope offset (index + offset, every axis).
                "positions": ((rows,), i64),
                "slot_mapping": ((rows,), i64),
                "mtp_positions": ((mtp_rows,), i64),
                "mtp_slot_mapping": ((mtp_rows,), i64),
                "state_slots": ((max_batch,), i64),
                "drafts": ((max_batch, k), i64),
                "num_drafts": ((max_batch,), i64),
                "base": ((max_batch,), i64),
                "limits": ((max_batch,), i64),
                "rope_offsets": ((max_batch,), i64),
                "position_top_ks": ((rows,), i64),
                "request_top_ks": ((max_batch,), i64),
                "seq_lens": ((max_batch,), i32),
                "mtp_seq_lens": ((max_batch,), i32),
                "uniforms": ((max_batch, k), f32),
                "draft_noise": ((max_batch, 2 * k, TOP_K_CAP), f32),
                "position_floats": ((rows, _NUM_FLOAT_PARAMS), f32),
                "position_noise": ((rows, TOP_K_CAP), f32),
                "request_floats": ((max_batch, _NUM_FLOAT_PARAMS), f32),
                "position_greedy": ((rows,), torch.bool),
                "request_greedy": ((max_batch,), torch.bool),
                "num_penalty_entries": ((1,), i64),
            },
            self.device,
        )
        self.penalties = VerifyPenalties(max_batch, max_pages_per_request * self.page_size,
                                         speculator.verify_logits.shape[-1], k, self.device)
        self.pages = GraphPageTable(max_batch, max_pages_per_request, self.device)
        self.page_table = self.pages.table
        self.outcome = torch.zeros(max_batch, 1 + (k + 1) + k, dtype=torch.int64, device=self.device)
        # Per batch size: the row layout's constants (every chunk a verification row of K+1).
        self._constants = {b: self._layout(b) for b in self.batch_sizes}
        self._request_noise = torch.ones(max_batch, TOP_K_CAP, dtype=f32, device=self.device)  # unused by propose
        self.forward_graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.judge_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph | None] = {}
        # A batch-1 round over a plain decode round, timed once captured (runner_graphs.time_round_ratio).
        self.round_cost_ratio: float | None = None
        self._outputs: dict[tuple, torch.Tensor] = {}
        # run_uncaptured(): the regions run directly (tests on the CPU), with the round's true
        # sequence lengths in the host copies the reference kernels loop over.
        self._uncaptured = False
        self._host_computed: tuple[int, ...] = ()

    def _layout(self, batch_size: int) -> dict[str, torch.Tensor]:
        k = self.num_draft_tokens
        rows = batch_size * (k + 1)
        request = np.arange(batch_size, dtype=np.int64)
        mtp_row = np.arange(k + 2, dtype=np.int64)
        starts = request[:, None] * (k + 1)
        # The drafter's row r of request b reads the target's token r (its last row: none yet) and the
        # target's hidden at r - 1 (row 0: the slot's, appended after the target rows), as plan_step.
        token_index = np.where(mtp_row < k + 1, starts + mtp_row, -1).reshape(-1)
        hidden_index = np.where(mtp_row > 0, starts + mtp_row - 1, rows + request[:, None]).reshape(-1)
        arrays = {
            "query_start_loc": (np.arange(batch_size + 1) * (k + 1)).astype(np.int32),
            "mtp_query_start_loc": (np.arange(batch_size + 1) * (k + 2)).astype(np.int32),
            "token_index": token_index,
            "hidden_index": hidden_index,
            "first_draft_rows": request * (k + 2) + 1,
        }
        return {name: torch.from_numpy(a).to(self.device) for name, a in arrays.items()}

    # ---- the captured regions --------------------------------------------------------
    def _target_batch(self, batch_size: int) -> ForwardBatch:
        v, rows = self.inputs.views, batch_size * (self.num_draft_tokens + 1)
        positions = v["positions"][:rows]
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        batch = ForwardBatch(
            positions=positions.unsqueeze(0).expand(3, -1) if self.mrope else positions,
            query_start_loc=self._constants[batch_size]["query_start_loc"],
            seq_lens=v["seq_lens"][:batch_size],
            page_table=self.page_table[:batch_size],
            state_slots=v["state_slots"][:batch_size],
            logits_indices=empty,
            slot_mapping=v["slot_mapping"][:rows],
            kv_cache=self.kv_cache,
            state_cache=self.state_cache,
            # Host copies fix the code path and the grids (K+1 queries per request); the lengths in
            # them are stale at replay and nothing inside the graph reads them.
            query_lens_cpu=(self.num_draft_tokens + 1,) * batch_size,
            seq_lens_cpu=self._host_seq_lens(batch_size, self.num_draft_tokens + 1),
            verify=VerifyRows(batch_size, rows, self.speculator.scratch),
        )
        # The drafter's residual streams (DFlash): the speculator's persistent buffer, the same in
        # the forward that writes them and the drafter that reads them.
        self.speculator.request_aux_hidden(batch, rows)
        return batch

    def _spec_inputs(self, batch_size: int, all_greedy: bool) -> SpecInputs:
        v, k, b = self.inputs.views, self.num_draft_tokens, batch_size
        rows, mtp_rows = b * (k + 1), b * (k + 2)
        constants = self._constants[b]
        mtp_positions = v["mtp_positions"][:mtp_rows]
        mtp_batch = ForwardBatch(
            positions=mtp_positions.unsqueeze(0).expand(3, -1) if self.mrope else mtp_positions,
            query_start_loc=constants["mtp_query_start_loc"],
            seq_lens=v["mtp_seq_lens"][:b],
            page_table=self.page_table[:b],
            state_slots=v["state_slots"][:b],
            logits_indices=torch.zeros(0, dtype=torch.int64, device=self.device),
            slot_mapping=v["mtp_slot_mapping"][:mtp_rows],
            kv_cache=self.kv_cache,
            state_cache=None,
            query_lens_cpu=(k + 2,) * b,
            seq_lens_cpu=self._host_seq_lens(b, k + 2),
        )

        def sampling(num_rows: int, floats, top_ks, greedy, noise) -> SamplingBatch:
            return SamplingBatch(
                num_rows=num_rows, row_floats=floats, top_ks=top_ks, is_greedy=greedy, noise=noise,
                penalty_rows=None, penalty_token_ids=None, all_greedy=all_greedy, any_greedy=True, has_penalties=False,
            )

        slots = v["state_slots"][:b]
        return SpecInputs(
            drafts=v["drafts"][:b],
            num_drafts=v["num_drafts"][:b],
            uniforms=v["uniforms"][:b],
            slots=slots,
            draft_noise=v["draft_noise"][:b],
            position_sampling=sampling(rows, v["position_floats"][:rows], v["position_top_ks"][:rows],
                                       v["position_greedy"][:rows], v["position_noise"][:rows]),
            request_sampling=sampling(b, v["request_floats"][:b], v["request_top_ks"][:b], v["request_greedy"][:b],
                                      self._request_noise[:b]),
            mtp_batch=mtp_batch,
            mtp_slots=slots,
            token_index=constants["token_index"],
            hidden_index=constants["hidden_index"],
            first_draft_rows=constants["first_draft_rows"],
            base=v["base"][:b],
            limits=v["limits"][:b],
            rope_offsets=v["rope_offsets"][:b],
            penalty_counts=None if all_greedy else self.penalties.counts(
                b, v["num_penalty_entries"], v["drafts"][:b], v["num_drafts"][:b]),
        )

    def _host_seq_lens(self, batch_size: int, num_new: int) -> tuple[int, ...]:
        if self._uncaptured:
            return tuple(c + num_new for c in self._host_computed)
        return (num_new,) * batch_size

    def _forward(self, batch_size: int) -> torch.Tensor:
        """Captured: static inputs -> the rows' hidden states (their logits in the speculator's buffer)."""
        rows = batch_size * (self.num_draft_tokens + 1)
        hidden = self.model(self.inputs.views["token_ids"][:rows], self._target_batch(batch_size))
        self.speculator.score(hidden, rows)
        return hidden

    def _judge(self, batch_size: int, all_greedy: bool) -> torch.Tensor:
        """Captured: the forward's logits and hidden -> outcome rows [B, 1 + (K+1) + K]."""
        rows = batch_size * (self.num_draft_tokens + 1)
        speculator = self.speculator
        inputs = self._spec_inputs(batch_size, all_greedy)
        num_accepted, tokens = speculator.accept(speculator.verify_logits[:rows], inputs)
        out = speculator.draft(
            self._outputs[("forward", batch_size)], self._target_batch(batch_size),
            self.inputs.views["token_ids"][:rows], inputs, batch_size, num_accepted, tokens,
        )
        self.outcome[:batch_size].copy_(out)
        return self.outcome[:batch_size]

    # ---- capture -------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, pool) -> None:
        """Capture every batch size into `pool` (largest first sizes it). MoE rounds whose rows
        route more (token, expert) pairs than the capture-safe expert kernels take run eagerly."""
        self._fill_dummy_inputs()
        config = self.model.config
        for batch_size in reversed(self.batch_sizes):
            rows = batch_size * (self.num_draft_tokens + 2)  # the drafter's pass: one row more per request
            if config.is_moe:
                from ninfer.kernels.moe.kernel_choice import DECODE_MAX_PAIRS

                if rows * config.num_experts_per_tok > DECODE_MAX_PAIRS:
                    log.info("verify graphs: batch %d (%d rows) routes more expert pairs than a capture takes; eager",
                             batch_size, rows)
                    continue
            regions = [(("forward", batch_size), lambda b=batch_size: self._forward(b))]
            regions += [(("judge", batch_size, greedy), lambda b=batch_size, g=greedy: self._judge(b, g))
                        for greedy in (True, False)]
            for key, region in regions:
                graph, self._outputs[key] = capture_graph(region, pool, self.device)
                if key[0] == "forward":
                    self.forward_graphs[batch_size] = graph
                else:
                    self.judge_graphs[key[1:]] = graph

    def _fill_dummy_inputs(self) -> None:
        """Valid inputs for the warm-up runs: token 0 at positions from 0 on page 0, greedy rows,
        slots 0..max_batch-1 (the runner zeroes what they wrote afterwards)."""
        k, views = self.num_draft_tokens, self.inputs.views
        for name in ("token_ids", "slot_mapping", "mtp_slot_mapping", "drafts", "num_drafts", "rope_offsets",
                     "num_penalty_entries"):
            views[name].zero_()
        for name in ("position_top_ks", "request_top_ks", "position_greedy", "request_greedy"):
            views[name].fill_(1)
        for name in ("uniforms", "draft_noise", "position_noise"):
            views[name].fill_(1.0)
        for name in ("position_floats", "request_floats"):
            views[name].zero_()
            views[name][:, :2] = 1.0  # temperature, top_p
        positions = torch.arange(k + 2, device=self.device)
        views["positions"].copy_(positions[: k + 1].repeat(self.max_batch))
        views["mtp_positions"].copy_(positions.repeat(self.max_batch))
        views["seq_lens"].fill_(k + 1)
        views["mtp_seq_lens"].fill_(k + 2)
        views["state_slots"].copy_(torch.arange(self.max_batch, device=self.device))
        views["base"].fill_(1)
        views["limits"].fill_(k + 2)
        self.inputs.copy_to_mirrors()
        self.page_table.zero_()
        self.pages.forget()

    def run_uncaptured(self) -> None:
        """Run the regions directly instead of replaying graphs (the CPU tests of the layout)."""
        self._uncaptured = True
        self._fill_dummy_inputs()
        for batch_size in self.batch_sizes:
            self.forward_graphs[batch_size] = None
            for greedy in (True, False):
                self.judge_graphs[(batch_size, greedy)] = None

    # ---- replay --------------------------------------------------------------------
    def can_run(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """A round of verification rows only, of a captured size, whose penalized requests' output
        tokens fit the penalty buffer."""
        if len(chunks) not in self.forward_graphs:
            return False
        width = self.num_draft_tokens + 1
        return all(
            c.speculative and len(c.token_ids) == width and c.previous_row is None and len(c.page_ids) <= self.max_pages
            for c in chunks
        ) and self.penalties.fits(chunks)

    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Replay the graphs of len(chunks) requests; -> their outcome rows on the device (a view
        of this object's buffer, valid until the next run)."""
        batch_size, k, page_size = len(chunks), self.num_draft_tokens, self.page_size
        rows, mtp_rows = batch_size * (k + 1), batch_size * (k + 2)
        host = self.inputs.next_mirror()
        host["token_ids"][:rows] = np.fromiter(chain.from_iterable(c.token_ids for c in chunks), np.int64, rows)
        computed = np.array([c.num_computed_tokens for c in chunks], dtype=np.int64)
        positions = computed[:, None] + np.arange(k + 2, dtype=np.int64)
        rope_offsets = np.array([c.rope_offset for c in chunks], dtype=np.int64)
        rotary = positions + rope_offsets[:, None]  # every row decodes past its prompt
        host["positions"][:rows] = rotary[:, : k + 1].reshape(-1)
        host["mtp_positions"][:mtp_rows] = rotary.reshape(-1)
        host["rope_offsets"][:batch_size] = rope_offsets
        mapping = np.empty((batch_size, k + 2), dtype=np.int64)
        for row, chunk in enumerate(chunks):
            # Only the round's pages: a long context's page list is thousands of ids.
            page_ids = chunk.page_ids
            mapping[row] = [page_ids[p] for p in (positions[row] // page_size).tolist()]
            self.pages.upload(row, page_ids)
        mapping = mapping * page_size + positions % page_size
        host["slot_mapping"][:rows] = mapping[:, : k + 1].reshape(-1)
        host["mtp_slot_mapping"][:mtp_rows] = mapping.reshape(-1)
        host["seq_lens"][:batch_size] = computed + k + 1
        host["mtp_seq_lens"][:batch_size] = computed + k + 2
        host["state_slots"][:batch_size] = [c.state_slot for c in chunks]
        host["drafts"][:batch_size] = host["token_ids"][:rows].reshape(batch_size, k + 1)[:, 1:]
        host["num_drafts"][:batch_size] = [c.num_draft_tokens for c in chunks]
        host["base"][:batch_size] = computed + 1
        host["limits"][:batch_size] = [len(c.page_ids) * page_size for c in chunks]
        host["num_penalty_entries"][0] = self.penalties.fill(chunks)
        # Penalised greedy rows take the general graph: its rows count the drafts before them too.
        all_greedy = all(c.sampling.is_greedy and not has_penalties(c.sampling) for c in chunks)
        if all_greedy:
            # Argmax rows read no sampling parameters: the general defaults, without packing any.
            self._fill_greedy_sampling(host, batch_size, rows)
        else:
            plan = plan_step(chunks, batch_size, k, page_size, penalty_lists=False)
            positions_sampling, request_sampling = plan.position_sampling, plan.request_sampling
            host["uniforms"][:batch_size] = plan.uniforms
            host["draft_noise"][:batch_size] = plan.draft_noise
            host["position_floats"][:rows] = positions_sampling.row_floats.numpy()
            host["position_top_ks"][:rows] = positions_sampling.top_ks.numpy()
            host["position_greedy"][:rows] = positions_sampling.is_greedy.numpy()
            host["position_noise"][:rows] = positions_sampling.noise.numpy()
            host["request_floats"][:batch_size] = request_sampling.row_floats.numpy()
            host["request_top_ks"][:batch_size] = request_sampling.top_ks.numpy()
            host["request_greedy"][:batch_size] = request_sampling.is_greedy.numpy()
        self.inputs.upload()
        if self._uncaptured:
            self._host_computed = tuple(computed.tolist())
            self._outputs[("forward", batch_size)] = self._forward(batch_size)
            self._judge(batch_size, all_greedy)
        else:
            self.forward_graphs[batch_size].replay()
            self.judge_graphs[(batch_size, all_greedy)].replay()
        return self.outcome[:batch_size]

    @staticmethod
    def _fill_greedy_sampling(host: dict[str, np.ndarray], batch_size: int, rows: int) -> None:
        """What SamplingBatch.build packs for greedy rows (temperature and top_p 1, top_k 1, no noise)."""
        for prefix, count in (("position", rows), ("request", batch_size)):
            floats = host[f"{prefix}_floats"][:count]
            floats[:] = 0.0
            floats[:, :2] = 1.0
            host[f"{prefix}_top_ks"][:count] = 1
            host[f"{prefix}_greedy"][:count] = True
        host["position_noise"][:rows] = 1.0
        host["uniforms"][:batch_size] = 1.0
        host["draft_noise"][:batch_size] = 1.0
