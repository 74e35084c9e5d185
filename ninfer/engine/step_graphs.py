"""StepGraphs: CUDA graphs of prompt and mixed steps, one per token bucket.

A step that carries prompt tokens runs the same kernels as a decode round, layer by layer, but
eagerly it costs the host ~1,000 launches: below ~1K tokens that host work, not the GPU, sets the
step's time. Here such steps replay a graph captured for the smallest token bucket
that holds them (powers of two from 16, plus the most decode rows a step can carry, up to the
largest bucket, and the row counts where layers leave the GEMV for a matmul: 16 for 16-bit and
NVFP4 layers, the GEMV's largest with FP8 weights), in two variants: with and without
checkpoints inside the step (models/step_snapshots.py). The server captures them while the engine
is idle, one per loop turn, once it is ready (a restart is ready sooner; until a step's graph is
captured it runs eagerly); a benchmark, a test or a tensor-parallel engine captures them all at
start-up.

A graph's shape is fixed, so a step is padded to it (models/padded_step.py): its requests fill
the first rows of a request table of max_requests + 1 rows, the others are empty (no rows, the
scratch state slot), and the flat rows past the step's tokens belong to no request (token 0,
their KV written to the scratch page, their outputs never read). The last table row is always
empty: the chunk lists of the gated delta rule are padded with chunks of it, which no kernel
program loads or stores. Every per-step value lives in static buffers that the host fills in
pinned memory and copies with one transfer per buffer; the page table's rows are uploaded only
when they change (GraphPageTable). Logits are computed for max_requests + 1 rows (the unused ones
go to the scratch slot), and the runner samples from the slots' logits as after an eager step.

Steps stay eager when a graph cannot hold them: more tokens than the largest bucket, more
requests, media rows (the vision tower's), speculative verification rows. The runner builds no
step graphs under --spec (the drafter reads every prompt step's hidden states). MoE layers run
in them as eagerly: their expert order and grouped products take sizes from the shapes alone
(kernels/moe), the rows of no request route like any other (their outputs are never read), and a
bucket ends at each token count where the expert kernels or tiles change (kernels/moe's
kernel_choice), so a padded step sums in its eager step's order.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import numpy as np
import torch

from ninfer.contract.sampling import SamplingParams
from ninfer.engine.graph_capture import capture_graph
from ninfer.engine.graph_page_table import GraphPageTable
from ninfer.engine.scheduler import ScheduledChunk
from ninfer.engine.step_layout import StepLayout
from ninfer.models.causal_lm import CausalLM
from ninfer.models.forward_batch import ForwardBatch
from ninfer.models.kv_cache import KVCache
from ninfer.models.padded_step import RULE_CHUNK, PaddedStep, RuleSegments
from ninfer.models.state_cache import StateCache
from ninfer.models.step_snapshots import StepSnapshots

SMALLEST_BUCKET = 16
# Buckets at three halves of each power of two from 256 up as well (384, 768, 1536): a step just
# past a power of two pads by half instead of doubling. Off until its products are timed at
# those row counts (benchmarks/kernels/bench_gemm_rows.py; step_shapes.py --three-half-buckets).
THREE_HALF_BUCKETS = False
# Pinned host mirrors per buffer: a step may be launched while the previous one's copies are
# still queued (the runner keeps at most two steps unread).
_NUM_STAGING = 2
_NUM_PASSES = 2  # the rule's passes: all requests, then those continuing at a checkpoint
GREEDY = SamplingParams(temperature=0.0, seed=0)


def token_buckets(max_tokens: int, kernel_switches: Sequence[int] = ()) -> list[int]:
    """Powers of two from SMALLEST_BUCKET below max_tokens (with THREE_HALF_BUCKETS also 3/2 of
    each from 256), max_tokens itself, and each of kernel_switches below max_tokens.

    A full step holds the scheduler's power-of-two budget, decode rows included
    (SchedulerLimits.mixed_prompt_budget): the 27B's matmuls cost 13% more at 1,032 rows than at
    1,024 and 20% more at 520 than at 512, so a bucket just past a power of two would cost every
    full step that much.
    kernel_switches: the row counts up to which a layer keeps one kernel (the GEMV's largest
    M): a bucket ending there pads a step no further than its eager kernels go."""
    buckets = set(kernel_switches) & set(range(1, max_tokens))
    size = SMALLEST_BUCKET
    while size < max_tokens:
        buckets.add(size)
        if THREE_HALF_BUCKETS and size >= 256 and size * 3 // 2 < max_tokens:
            buckets.add(size * 3 // 2)
        size *= 2
    return sorted(buckets) + [max_tokens]


class _StaticFields:
    """Named slices of one device buffer, with pinned host mirrors filled per step."""

    def __init__(self, sizes: dict[str, int], dtype: torch.dtype, device: torch.device):
        self.offsets: dict[str, tuple[int, int]] = {}
        total = 0
        for name, size in sizes.items():
            self.offsets[name] = (total, total + size)
            total += size
        self.device = torch.zeros(total, dtype=dtype, device=device)
        pin = device.type == "cuda"
        self._host = [torch.zeros(total, dtype=dtype, pin_memory=pin) for _ in range(_NUM_STAGING)]

    def __getitem__(self, name: str) -> torch.Tensor:
        lo, hi = self.offsets[name]
        return self.device[lo:hi]

    def host(self, turn: int) -> dict[str, np.ndarray]:
        array = self._host[turn].numpy()
        return {name: array[lo:hi] for name, (lo, hi) in self.offsets.items()}

    def upload(self, turn: int) -> None:
        self.device.copy_(self._host[turn], non_blocking=True)


class StepGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        state_cache: StateCache | None,
        slot_logits: torch.Tensor,
        num_valid_tokens: int,
        buckets: Sequence[int],
        max_requests: int,
        max_pages_per_request: int,
        scratch_slot: int,
        scratch_page: int,
        keep_hidden: bool = False,
    ):
        """buckets: the token counts to capture; max_requests: a step's requests at most (a chunk
        with a checkpoint inside it counts twice); scratch_slot / scratch_page: a state slot and a
        KV page no request uses, which padding reads and writes. keep_hidden: keep each graph's
        final hidden states for reading after a replay (`hidden`: the MTP head's pass)."""
        self.model = model
        self.kv_cache = kv_cache
        self.state_cache = state_cache
        self.slot_logits = slot_logits
        self.num_valid_tokens = num_valid_tokens
        self.buckets = sorted(set(buckets))
        self.max_tokens = self.buckets[-1]
        self.num_rows = max_requests + 1  # the request table; its last row always empty
        self.max_pages = max_pages_per_request
        self.scratch_slot = scratch_slot
        self.scratch_page = scratch_page
        self.device = slot_logits.device
        self.page_size = kv_cache.page_size
        self.mrope = model.config.mrope_section is not None
        tokens, rows = self.max_tokens, self.num_rows
        chunks = PaddedStep.max_chunks(tokens, rows)
        ints = {"tokens": tokens, "positions": tokens, "slot_mapping": tokens, "state_slots": rows,
                "logits_rows": rows, "logits_slots": rows, "snapshot_src": rows, "snapshot_dst": rows,
                "chained_offsets": rows, "chained_rows": rows}
        int32s = {"query_start_loc": rows + 1, "seq_lens": rows}
        for p in range(_NUM_PASSES):
            ints |= {f"slots{p}": rows, f"starts{p}": rows + 1, f"chunks{p}": 2 * chunks, f"chunk_offsets{p}": rows + 1}
            int32s[f"conv_starts{p}"] = rows + 1
        self.ints = _StaticFields(ints, torch.int64, self.device)
        self.int32s = _StaticFields(int32s, torch.int32, self.device)
        self.second_rows = _StaticFields({"rows": tokens}, torch.bool, self.device)
        self.pages = GraphPageTable(rows, max_pages_per_request, self.device)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (bucket, checkpoints inside)
        # On CUDA a step replays only a captured graph; on the CPU (tests) the forward runs uncaptured.
        self.captures = self.device.type == "cuda"
        # What is left to capture, largest first (it sizes the shared memory pool).
        self.pending: list[tuple[int, bool]] = [(b, s) for b in reversed(self.buckets) for s in (False, True)]
        self.capture_seconds = 0.0
        self.last_phases: dict[str, float] = {}  # host seconds of the last capture's parts (capture_graph)
        self._pool = None
        self._num_runs = 0
        self.keep_hidden = keep_hidden
        self._hidden: dict[tuple[int, bool], torch.Tensor] = {}
        self._last_run: tuple[int, bool] | None = None

    # ---- capture -------------------------------------------------------------------
    def capture(self, pool=None) -> None:
        """Capture every bucket now."""
        self.begin_capture(pool)
        while self.pending:
            self.capture_next()

    def begin_capture(self, pool=None) -> None:
        """Set the memory pool the graphs capture into; capture_next() then captures them one by one."""
        self._pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    @torch.inference_mode()
    def capture_next(self) -> None:
        """Capture the next pending graph from a dummy step on the scratch slot and page, then clear
        what its warm-up run wrote there. Between steps only: the graph's buffers are the steps'."""
        bucket, snapshots = self.pending.pop(0)
        started = time.perf_counter()
        self.last_phases = {}
        try:
            self._stage(StepLayout.of(self._dummy_step(bucket, snapshots)), bucket, None)
            region = functools.partial(self._forward, bucket, snapshots)
            graph, _ = capture_graph(region, self._pool, self.device, self.last_phases)
            self.graphs[(bucket, snapshots)] = graph
        finally:
            discarding = time.perf_counter()
            self.discard_warmup_writes()
            self.last_phases["discard"] = time.perf_counter() - discarding
            self.capture_seconds += time.perf_counter() - started

    def _dummy_step(self, bucket: int, snapshots: bool) -> list[ScheduledChunk]:
        """A prompt chunk on the scratch slot and page (with a checkpoint inside it when snapshots,
        else beside a decode row): what the warm-up runs before capture compute. The graph's shape
        is the bucket's whatever the dummy's tokens; they stay within a request's pages."""
        pages = [self.scratch_page] * self.max_pages
        num_tokens = min(bucket - 1, self.max_pages * self.page_size - 1)
        prompt = ScheduledChunk("capture", [0] * num_tokens, 0, pages, self.scratch_slot, True, False, GREEDY, 0, [],
                                snapshot_tokens=num_tokens // 2 if snapshots else 0,
                                snapshot_slot=self.scratch_slot if snapshots else None)
        if snapshots:
            return [prompt]
        return [ScheduledChunk("capture-decode", [0], 0, pages, self.scratch_slot, True, False, GREEDY, 0, []), prompt]

    def discard_warmup_writes(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.kv_cache.k[:, self.scratch_page].zero_()
        self.kv_cache.v[:, self.scratch_page].zero_()
        if self.state_cache is not None:
            self.state_cache.reset(self.scratch_slot)
        self.slot_logits[self.scratch_slot].zero_()
        self.pages.forget()

    def _forward(self, bucket: int, snapshots: bool) -> torch.Tensor:
        """Captured: the static buffers' step -> logits [rows, V] fp32, also written to their slots."""
        ints, int32s = self.ints, self.int32s
        num_chunks = PaddedStep.max_chunks(bucket, self.num_rows)
        passes = tuple(
            RuleSegments(ints[f"slots{p}"], int32s[f"conv_starts{p}"], ints[f"starts{p}"],
                         ints[f"chunks{p}"][: 2 * num_chunks].view(num_chunks, 2), ints[f"chunk_offsets{p}"])
            for p in range(2 if snapshots else 1)
        )
        second_rows = self.second_rows["rows"][:bucket].view(bucket, 1, 1) if snapshots else None
        positions = ints["positions"][:bucket]
        batch = ForwardBatch(
            positions=positions.unsqueeze(0).expand(3, -1) if self.mrope else positions,
            query_start_loc=int32s["query_start_loc"],
            seq_lens=int32s["seq_lens"],
            page_table=self.pages.table,
            state_slots=ints["state_slots"],
            logits_indices=ints["logits_rows"],
            slot_mapping=ints["slot_mapping"][:bucket],
            kv_cache=self.kv_cache,
            state_cache=self.state_cache,
            # No host copies of the lengths: every kernel reads the device buffers (at replay the
            # capture's copies would be stale).
            query_lens_cpu=None,
            seq_lens_cpu=None,
            snapshots=StepSnapshots(ints["snapshot_src"], ints["snapshot_dst"], 0) if snapshots else None,
            padded=PaddedStep(bucket, passes, second_rows),
        )
        hidden = self.model(ints["tokens"][:bucket], batch)
        if self.keep_hidden:
            self._hidden[(bucket, snapshots)] = hidden  # held: the pool keeps it past the capture
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices)).float()
        if self.num_valid_tokens < logits.shape[-1]:
            logits[:, self.num_valid_tokens :] = float("-inf")
        self.slot_logits.index_copy_(0, ints["logits_slots"], logits)
        return logits

    # ---- replay --------------------------------------------------------------------
    def can_run(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """A step of text prompt chunks and decode rows that a captured bucket holds (only its own
        bucket: a larger one may cross a kernel switch, and the step would not sum as it does eagerly)."""
        num_snapshots = sum(c.snapshot_slot is not None for c in chunks)
        num_parts = len(chunks) + num_snapshots
        num_tokens = sum(len(c.token_ids) for c in chunks)
        return (
            0 < num_parts < self.num_rows
            and num_tokens <= self.max_tokens
            and (not self.captures or (self._bucket_of(num_tokens), num_snapshots > 0) in self.graphs)
            and all(
                c.token_ids
                and not c.speculative
                and not c.media
                and c.rope_positions is None
                and len(c.page_ids) <= self.max_pages
                for c in chunks
            )
        )

    def run(self, chunks: list[ScheduledChunk], previous_ids: torch.Tensor | None) -> None:
        """Replay the step's bucket: the forward, with the logits of the rows that keep them in
        their slots. previous_ids: the previous launch's sampled ids by row (chained chunks)."""
        layout = StepLayout.of(chunks)
        bucket = self._bucket_of(layout.num_tokens)
        snapshots = bool(layout.snapshotting)
        self._stage(layout, bucket, previous_ids)
        self._last_run = (bucket, snapshots)
        if self.captures:
            self.graphs[(bucket, snapshots)].replay()
        else:  # uncaptured (CPU): the same forward over the same buffers
            self._forward(bucket, snapshots)

    @property
    def hidden(self) -> torch.Tensor:
        """The last replayed step's final hidden states [bucket, H], its rows in chunk order (with
        keep_hidden, and no checkpoint inside the step); valid until the next replay."""
        return self._hidden[self._last_run]

    @property
    def token_ids(self) -> torch.Tensor:
        """The last replayed step's input tokens [max_tokens] on the device, chained rows filled in."""
        return self.ints["tokens"]

    def _bucket_of(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def _stage(self, layout: StepLayout, bucket: int, previous_ids: torch.Tensor | None) -> None:
        """Fill the static buffers for a step padded to bucket."""
        turn = self._num_runs % _NUM_STAGING
        self._num_runs += 1
        ints, int32s, second = self.ints.host(turn), self.int32s.host(turn), self.second_rows.host(turn)["rows"]
        parts, rows, scratch = layout.parts, self.num_rows, self.scratch_slot
        num_parts, num_tokens = len(parts), layout.num_tokens
        lens = np.zeros(rows, dtype=np.int64)
        lens[:num_parts] = layout.query_lens
        starts = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(lens, out=starts[1:])
        computed = np.zeros(rows, dtype=np.int64)
        computed[:num_parts] = [p.num_computed_tokens for p in parts]
        slots = np.full(rows, scratch, dtype=np.int64)
        slots[:num_parts] = [p.chunk.state_slot for p in parts]

        ints["tokens"][:num_tokens] = layout.token_array()
        ints["tokens"][num_tokens:] = 0
        positions = np.arange(num_tokens) + np.repeat(computed[:num_parts] - starts[:num_parts], lens[:num_parts])
        ints["positions"][:num_tokens] = positions
        ints["positions"][num_tokens:] = 0
        page_size = self.page_size
        for row, part in enumerate(parts):
            pos = positions[starts[row] : starts[row + 1]]
            first = pos[0] // page_size
            pages = np.asarray(part.chunk.page_ids[first : pos[-1] // page_size + 1], dtype=np.int64)
            pages_of_rows = pages[pos // page_size - first]
            ints["slot_mapping"][starts[row] : starts[row + 1]] = pages_of_rows * page_size + pos % page_size
            self.pages.upload(row, part.chunk.page_ids)
        ints["slot_mapping"][num_tokens:] = self.scratch_page * page_size
        int32s["query_start_loc"][:] = starts
        int32s["seq_lens"][:] = computed + lens  # 0 for the empty requests
        ints["state_slots"][:] = slots

        num_logits = len(layout.logits_rows)
        ints["logits_rows"][:num_logits] = layout.logits_rows
        ints["logits_rows"][num_logits:] = 0
        ints["logits_slots"][:num_logits] = layout.logits_slots
        ints["logits_slots"][num_logits:] = scratch

        # The rule's passes: the requests before the continuing ones, then (if any) those.
        first_continuing = num_parts - layout.num_continuing
        split_row = int(starts[first_continuing])
        num_chunks = PaddedStep.max_chunks(bucket, rows)
        passes = ((0, first_continuing), (first_continuing, num_parts))[: 2 if layout.num_continuing else 1]
        for p, (lo, hi) in enumerate(passes):
            in_pass = np.zeros(rows, dtype=bool)
            in_pass[lo:hi] = True
            pass_starts = np.clip(starts, starts[lo], starts[hi])
            pass_lens = np.where(in_pass, lens, 0)
            ints[f"starts{p}"][:] = pass_starts
            int32s[f"conv_starts{p}"][:] = pass_starts
            ints[f"slots{p}"][:] = np.where(in_pass, slots, scratch)
            counts = -(-pass_lens // RULE_CHUNK)
            offsets = ints[f"chunk_offsets{p}"]
            offsets[0] = 0
            np.cumsum(counts, out=offsets[1:])
            chunk_list = ints[f"chunks{p}"][: 2 * num_chunks].reshape(num_chunks, 2)
            total = int(offsets[-1])
            chunk_list[:total, 0] = np.repeat(np.arange(rows), counts)
            chunk_list[:total, 1] = np.arange(total) - np.repeat(offsets[:-1], counts)
            chunk_list[total:] = (rows - 1, 0)  # the last request, always empty
        num_continuing = layout.num_continuing
        ints["snapshot_src"][:num_continuing] = [c.state_slot for c in layout.snapshotting]
        ints["snapshot_dst"][:num_continuing] = [c.snapshot_slot for c in layout.snapshotting]
        ints["snapshot_src"][num_continuing:] = scratch
        ints["snapshot_dst"][num_continuing:] = scratch
        second[:] = False
        second[split_row:num_tokens] = True

        num_chained = len(layout.chained_offsets)
        ints["chained_offsets"][:num_chained] = layout.chained_offsets
        ints["chained_rows"][:num_chained] = layout.chained_rows
        self.ints.upload(turn)
        self.int32s.upload(turn)
        self.second_rows.upload(turn)
        if num_chained:
            if previous_ids is None:
                raise ValueError("a chunk is chained to the previous step's ids, but none were given")
            # The ids the previous step sampled, still on the device (these chunks hold a placeholder).
            tokens = self.ints["tokens"]
            tokens.index_copy_(0, self.ints["chained_offsets"][:num_chained],
                               previous_ids.index_select(0, self.ints["chained_rows"][:num_chained]))
