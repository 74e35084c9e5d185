"""The eager step's staged metadata (one pinned buffer, one copy per flush) against the plain build.

ForwardBatch.stage must give the model exactly what ForwardBatch.build gave it, and the runner's
eager path (input ids, chained rows, logits slots, sampling rows) what the synchronous path
before it computed. The plan below mixes prefill rows of several lengths, decode rows at
num_computed_tokens > 0, a row that keeps logits without sampling, a sample-only row and
rounds launched ahead whose rows read the previous round's ids on the device; the GPU tests
(tests/gpu/test_eager_staging.py) run it on CUDA.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from ninfer.contract.sampling import SamplingParams
from ninfer.engine.runner import ModelRunner
from ninfer.engine.sampler import SamplingBatch
from ninfer.engine.scheduler import PENDING_TOKEN, ScheduledChunk, SchedulerStep, StepKind
from ninfer.models.causal_lm import CausalLM
from ninfer.models.config import ModelConfig
from ninfer.models.forward_batch import _MIN_STAGING_BYTES, ForwardBatch, HostStaging
from ninfer.models.kv_cache import KVCache
from tests.engine.test_engine_generation import _models

VOCAB = 257
PAGE_SIZE = 16
NUM_PAGES = 20
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=12, min_p=0.02, seed=1234)
PENALISED = SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, seed=99)
FIELDS = ("positions", "query_start_loc", "seq_lens", "page_table", "state_slots", "logits_indices", "slot_mapping")


@dataclass(frozen=True)
class Lane:
    slot: int
    pages: list[int]  # of different lengths, so the page table is padded
    sampling: SamplingParams
    history: list[int]  # output tokens so far (the penalised lane counts them)


def _lanes() -> dict[str, Lane]:
    pages = list(range(NUM_PAGES))
    random.Random(0).shuffle(pages)  # scattered pages: wrong indexing cannot go unnoticed
    return {
        "a": Lane(3, pages[0:3], GREEDY, []),
        "b": Lane(1, pages[3:7], PENALISED, [65, 66, 65, 200]),
        "c": Lane(0, pages[7:8], SAMPLED, [70]),
        "d": Lane(2, pages[8:9], GREEDY, []),
    }


def _tokens(start: int, count: int) -> list[int]:
    return [(7 * (start + i) + 3) % 200 + 32 for i in range(count)]


def _chunk(lane_id: str, tokens: list[int], computed: int, logits: bool = True, sample: bool = True,
           previous_row: int | None = None) -> ScheduledChunk:
    lane = _lanes()[lane_id]
    return ScheduledChunk(
        request_id=lane_id, token_ids=tokens, num_computed_tokens=computed, page_ids=lane.pages,
        state_slot=lane.slot, compute_logits=logits, sample=sample, sampling=lane.sampling,
        num_generated=len(lane.history), output_token_ids=lane.history, previous_row=previous_row,
    )


def _chained(lane_id: str, computed: int, previous_row: int) -> ScheduledChunk:
    return _chunk(lane_id, [PENDING_TOKEN], computed, previous_row=previous_row)


def plan() -> list[SchedulerStep]:
    """Five steps; steps 3 and 4 are launched before the step they chain to is read (run_plan)."""
    return [
        SchedulerStep(StepKind.PREFILL, [
            _chunk("a", _tokens(0, 37), 0),
            _chunk("b", _tokens(100, 20), 0, logits=False, sample=False),  # a first prompt chunk
            _chunk("c", _tokens(50, 5), 0),
        ]),
        SchedulerStep(StepKind.PREFILL, [
            _chunk("a", [40], 37),
            _chunk("b", _tokens(120, 30), 20),
            _chunk("c", [41], 5),
            _chunk("d", _tokens(9, 3), 0, sample=False),  # keeps its logits for a later sample-only row
        ]),
        SchedulerStep(StepKind.DECODE, [
            _chained("a", 38, 0), _chained("b", 50, 1), _chained("c", 6, 2),
            _chunk("d", [], 3),  # samples the logits stored by the previous step
        ]),
        SchedulerStep(StepKind.DECODE, [
            _chained("a", 39, 0), _chained("b", 51, 1), _chained("c", 7, 2), _chained("d", 3, 3),
        ]),
        SchedulerStep(StepKind.PREFILL, [
            _chunk("a", [42], 40), _chunk("c", _tokens(60, 6), 8), _chunk("d", [43], 4),
        ]),
    ]


def run_plan(runner: ModelRunner) -> tuple[list[dict[str, int]], list[torch.Tensor]]:
    """-> each step's sampled ids and the slot logits after each read (in launch order)."""
    steps = plan()
    results: list[dict[str, int]] = []
    logits: list[torch.Tensor] = []

    def read(pending) -> None:
        results.append(pending.result())
        logits.append(runner.slot_logits.clone())

    read(runner.launch(steps[0]))
    second = runner.launch(steps[1])
    third = runner.launch(steps[2])  # chained to the unread second step
    read(second)
    fourth = runner.launch(steps[3])
    read(third)
    read(fourth)
    read(runner.launch(steps[4]))
    return results, logits


def new_runner(cls: type[ModelRunner], model: CausalLM) -> ModelRunner:
    return cls(model, NUM_PAGES, PAGE_SIZE, num_state_slots=len(_lanes()))


class SynchronousRunner(ModelRunner):
    """The eager path as it was before staging (a copy per tensor, from pageable memory): the reference."""

    def _run_eagerly(self, chunks):
        computed = [c for c in chunks if c.token_ids]
        if computed:
            self._forward_synchronously(computed)
        sampled_rows = [row for row, c in enumerate(chunks) if c.sample]
        if not sampled_rows:
            return None, [], None
        to_sample = [chunks[row] for row in sampled_rows]
        slots = torch.tensor([c.state_slot for c in to_sample], device=self.device)
        logits = self.slot_logits.index_select(0, slots)
        batch = SamplingBatch.build(
            [c.sampling for c in to_sample], [c.output_token_ids for c in to_sample], device=self.device,
            num_generated=[c.num_generated for c in to_sample],
        )
        token_ids = self.sampler.sample(logits, batch)
        if len(sampled_rows) == len(chunks):
            return token_ids, sampled_rows, None
        by_row = torch.zeros(len(chunks), dtype=token_ids.dtype, device=self.device)
        by_row[sampled_rows] = token_ids
        return by_row, sampled_rows, None  # no speculative rows

    def _forward_synchronously(self, chunks):
        query_lens = [len(c.token_ids) for c in chunks]
        logits_rows, logits_slots, chained_offsets, chained_rows = [], [], [], []
        offset = 0
        for chunk, query_len in zip(chunks, query_lens):
            if chunk.previous_row is not None:
                chained_offsets.append(offset)
                chained_rows.append(chunk.previous_row)
            offset += query_len
            if chunk.compute_logits:
                logits_rows.append(offset - 1)
                logits_slots.append(chunk.state_slot)
        batch = ForwardBatch.build(
            query_lens, [c.num_computed_tokens for c in chunks], padded_page_table(chunks),
            [c.state_slot for c in chunks], self.kv_cache, self.state_cache, logits_indices=logits_rows,
            mrope=self.mrope, device=self.device,
        )
        input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64, device=self.device)
        if chained_offsets:
            input_ids[chained_offsets] = self._last_ids[chained_rows]
        hidden = self.model(input_ids, batch)
        if not logits_rows:
            return
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices)).float()
        if self.num_valid_tokens < logits.shape[-1]:
            logits[:, self.num_valid_tokens :] = float("-inf")
        self.slot_logits.index_copy_(0, torch.tensor(logits_slots, device=self.device), logits)


def padded_page_table(chunks: list[ScheduledChunk]) -> torch.Tensor:
    table = torch.zeros((len(chunks), max(len(c.page_ids) for c in chunks)), dtype=torch.int32)
    for row, chunk in enumerate(chunks):
        table[row, : len(chunk.page_ids)] = torch.tensor(chunk.page_ids, dtype=torch.int32)
    return table


def assert_same_batch(got: ForwardBatch, want: ForwardBatch) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, a.shape, b.dtype, b.shape)
            assert torch.equal(a.cpu(), b.cpu()), (name, a, b)
    assert got.query_lens_cpu == want.query_lens_cpu
    assert got.seq_lens_cpu == want.seq_lens_cpu


# ---- ForwardBatch.stage / HostStaging ------------------------------------------------------
@pytest.mark.parametrize("mrope", [False, True])
def test_stage_equals_build(mrope):
    # A prefill row long enough that its slot mapping alone outgrows the first staging buffer,
    # and the next array outgrows the second in mid-step (earlier views must stay valid).
    long_row = _MIN_STAGING_BYTES // 8 + 5
    query_lens = [5, 1, long_row, 1, 9, 3]
    computed = [0, 17, 6, 40, 33, 0]
    pages_needed = [-(-(c + q) // 4) for c, q in zip(computed, query_lens)]
    order = list(range(sum(pages_needed) + 7))
    random.Random(1).shuffle(order)
    page_ids, start = [], 0
    for row, needed in enumerate(pages_needed):
        spare = row % 3  # rows of different widths: the table is padded
        page_ids.append(order[start : start + needed + spare])
        start += needed + spare
    kv = KVCache.allocate(1, len(order), 4, 1, 1, torch.float32, torch.device("cpu"))
    slots = [4, 0, 5, 2, 1, 3]
    logits_rows = [4, 5, 5 + long_row, 16 + long_row]
    table = torch.zeros((len(page_ids), max(map(len, page_ids))), dtype=torch.int32)
    for row, pages in enumerate(page_ids):
        table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    want = ForwardBatch.build(query_lens, computed, table, slots, kv, None, logits_indices=logits_rows, mrope=mrope)

    staging = HostStaging("cpu", num_turns=2)
    staging.next_step()
    got = ForwardBatch.stage(query_lens, computed, page_ids, slots, kv, None, logits_rows, staging, mrope=mrope)
    staging.flush()
    assert_same_batch(got, want)
    assert got.positions.is_contiguous()


def test_host_staging_keeps_dtypes_shapes_and_earlier_steps():
    staging = HostStaging("cpu", num_turns=2)
    arrays = [
        np.arange(6, dtype=np.int64).reshape(2, 3),
        np.array([3, -1, 7], dtype=np.int32),
        np.array([[0.5, 2.0]], dtype=np.float32),
        np.array([True, False, True]),
        np.zeros(0, dtype=np.int64),
    ]
    kept = []
    for step in range(3):
        staging.next_step()
        staged = [staging.add(a + step if a.dtype != np.bool_ else a) for a in arrays]
        staging.flush()
        kept.append(staged)
    for step, staged in enumerate(kept):  # a later step reusing the turn left these intact
        for a, t in zip(arrays, staged):
            want = torch.from_numpy(a + step if a.dtype != np.bool_ else a)
            assert t.dtype == want.dtype and t.shape == want.shape
            assert torch.equal(t, want)


def test_sampling_batch_staged_with_the_step_equals_its_own():
    params = [GREEDY, SAMPLED, PENALISED]
    histories = [[], [70], [65, 66, 65]]
    alone = SamplingBatch.build(params, histories, num_generated=[0, 1, 3])
    staging = HostStaging("cpu")
    staging.next_step()
    staging.add(np.arange(5))  # the step's other metadata goes first
    shared = SamplingBatch.build(params, histories, num_generated=[0, 1, 3], staging=staging)
    staging.flush()
    for name in ("row_floats", "top_ks", "is_greedy", "noise", "penalty_rows", "penalty_token_ids"):
        a, b = getattr(shared, name), getattr(alone, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (shared.all_greedy, shared.any_greedy, shared.has_penalties) == (False, True, True)


# ---- the runner --------------------------------------------------------------------------
class RecordingLM(CausalLM):
    """Records what each forward receives; its next token is (input id * 31 + position) % VOCAB,
    so a chained row shows which id it read."""

    def __init__(self, mrope: bool):
        super().__init__()
        self.config = ModelConfig(
            model_type="recording", family="recording", vocab_size=VOCAB, hidden_size=2, num_hidden_layers=1,
            num_attention_heads=1, num_key_value_heads=1, head_dim=1, intermediate_size=1,
            layer_types=("full_attention",), mrope_section=(1, 0, 0) if mrope else None,
        )  # fmt: skip
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.calls: list[tuple[torch.Tensor, ForwardBatch]] = []

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        copies = {name: getattr(batch, name).clone() for name in FIELDS if getattr(batch, name) is not None}
        self.calls.append((input_ids.clone(), ForwardBatch(**{**vars(batch), **copies})))
        positions = batch.positions[0] if batch.positions.dim() == 2 else batch.positions
        return torch.stack([input_ids, positions], dim=1).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        target = (hidden[:, 0].long() * 31 + hidden[:, 1].long()) % VOCAB
        return torch.full((len(hidden), VOCAB), -1e9).scatter_(1, target[:, None], 0.0)


@pytest.mark.parametrize("mrope", [False, True])
def test_runner_feeds_the_model_what_the_plain_build_gives(mrope):
    model = RecordingLM(mrope)
    runner = new_runner(ModelRunner, model)
    results, _ = run_plan(runner)

    steps = plan()
    assert len(model.calls) == len(steps)
    for index, (step, (input_ids, got)) in enumerate(zip(steps, model.calls)):
        chunks = [c for c in step.chunks if c.token_ids]
        tokens = []
        for chunk in chunks:
            if chunk.previous_row is None:
                tokens.extend(chunk.token_ids)
            else:  # the id the step before sampled in that row
                tokens.append(results[index - 1][steps[index - 1].chunks[chunk.previous_row].request_id])
        assert input_ids.tolist() == tokens, f"step {index}"
        offsets = np.cumsum([len(c.token_ids) for c in chunks])
        want = ForwardBatch.build(
            [len(c.token_ids) for c in chunks], [c.num_computed_tokens for c in chunks], padded_page_table(chunks),
            [c.state_slot for c in chunks], runner.kv_cache, runner.state_cache,
            logits_indices=[int(o) - 1 for o, c in zip(offsets, chunks) if c.compute_logits], mrope=mrope,
        )
        assert_same_batch(got, want)

    # Every sampled id is the model's target for the row's last token (stored logits for "d" in step 3).
    last = {}
    for index, (step, (input_ids, got)) in enumerate(zip(steps, model.calls)):
        positions = got.positions[0] if mrope else got.positions
        ends = got.query_start_loc[1:].tolist()
        rows = {c.request_id: end - 1 for c, end in zip([c for c in step.chunks if c.token_ids], ends)}
        for rid, row in rows.items():
            last[rid] = (int(input_ids[row]) * 31 + int(positions[row])) % VOCAB
        assert results[index] == {c.request_id: last[c.request_id] for c in step.chunks if c.sample}, f"step {index}"


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("staging-models"))


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_staged_runner_equals_synchronous_runner(arch, tmp_root):
    model = _models(arch, tmp_root)[1]
    staged, reference = run_plan(new_runner(ModelRunner, model)), run_plan(new_runner(SynchronousRunner, model))
    assert staged[0] == reference[0]
    for step, (got, want) in enumerate(zip(staged[1], reference[1])):
        assert torch.equal(got, want), f"step {step}: max |diff| {(got - want).abs().max().item()}"
