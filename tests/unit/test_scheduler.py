"""Scheduler, pools and context cache with a strict fake runner (no model).

The fake runner stands in for the device: each state slot holds the token history it
summarises and each KV page the tokens written at its offsets. On every step it checks
that a chunk's slot summarises exactly token_ids[:num_computed] and that its pages hold
exactly those tokens, so restores, snapshots, sharing and copy-on-write are verified
the way the real model would depend on them. The "model" samples a deterministic
function of the whole history, so reuse must not change outputs.

Every test runs twice: stepping synchronously, and with decode overlap as EngineCore runs
it (the next round planned by schedule_ahead and launched before the current one is
committed; the fake runner feeds chained rows the ids it sampled in the previous step).
"""

from __future__ import annotations

import hashlib

import pytest

from ninfer.contract.output import EngineOutput, ErrorCode, FinishReason
from ninfer.contract.request import CaptureHint, EngineRequest, ThinkingBudget
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.cache.context_cache import CacheLimits, ContextCache
from ninfer.engine.cache.context_costs import ContextCosts
from ninfer.engine.kv_pool import KVPool
from ninfer.engine.scheduler import (
    PENDING_TOKEN,
    CopyPage,
    CopySlot,
    ResetSlot,
    RestorePages,
    RestoreSlot,
    Scheduler,
    SchedulerLimits,
    SchedulerStep,
    SpillPages,
    SpillSlot,
    StepKind,
)
from ninfer.engine.state_pool import StatePool
from ninfer.engine.stop_checker import StopChecker

VOCAB = 200  # sampled ids stay below the byte tokenizer's 256 symbols


def next_token(history: list[int]) -> int:
    digest = hashlib.sha256(bytes(str(history), "ascii")).digest()
    return 32 + digest[0] % 90  # printable ASCII


class FakeRunner:
    def __init__(self, num_pages: int, page_size: int, num_slots: int, recurrent: bool, num_host_slots: int = 0):
        self.recurrent = recurrent  # attention-only models carry no state in their slot
        self.page_size = page_size
        self.pages: dict[int, dict[int, int]] = {p: {} for p in range(num_pages)}
        self.slots: dict[int, list[int] | None] = {s: None for s in range(num_slots)}
        self.slot_logits: dict[int, list[int] | None] = {s: None for s in range(num_slots)}
        # Host tier: (state, logits) per slot; the None sentinel is what a never-written slot holds.
        self.host: dict[int, tuple[list[int] | None, list[int] | None]] = {
            s: (None, None) for s in range(num_host_slots)
        }
        self.host_pages: dict[int, dict[int, int]] = {}  # host KV page -> its positions' tokens
        self.sampled_by_row: dict[int, int] = {}  # the last step's sampled ids, for chained rows

    def execute(self, step: SchedulerStep, histories: dict[str, list[int]]) -> dict[str, int]:
        """histories: each request's tokens as the host knows them when the step is launched."""
        for action in step.before:
            if isinstance(action, ResetSlot):
                self.slots[action.slot] = []
                self.slot_logits[action.slot] = None
            elif isinstance(action, CopySlot):
                self.slots[action.dst] = list(self.slots[action.src])
                self.slot_logits[action.dst] = self.slot_logits[action.src]
            elif isinstance(action, CopyPage):
                self.pages[action.dst] = dict(self.pages[action.src])
            elif isinstance(action, SpillSlot):
                self.host[action.host_slot] = (self.slots[action.device_slot], self.slot_logits[action.device_slot])
                # The device slot is free once spilled: poison it so any read of it is caught.
                self.slots[action.device_slot] = self.slot_logits[action.device_slot] = ["spilled"]
            elif isinstance(action, RestoreSlot):
                state, logits = self.host[action.host_slot]
                self.slots[action.device_slot] = list(state)
                self.slot_logits[action.device_slot] = logits
            elif isinstance(action, SpillPages):
                for device_page, host_page in zip(action.device_pages, action.host_pages, strict=True):
                    self.host_pages[host_page] = dict(self.pages[device_page])
            elif isinstance(action, RestorePages):
                for host_page, device_page in zip(action.host_pages, action.device_pages, strict=True):
                    self.pages[device_page] = dict(self.host_pages[host_page])
        sampled_by_row = {}
        for row, chunk in enumerate(step.chunks):
            full = histories[chunk.request_id]
            computed = chunk.num_computed_tokens
            token_ids = chunk.token_ids
            if chunk.previous_row is not None:
                # Planned before the previous step was committed: the host cannot know the token.
                assert token_ids == [PENDING_TOKEN] and len(full) == computed
                token_ids = [self.sampled_by_row[chunk.previous_row]]
                full = full + token_ids
            if self.recurrent:
                assert self.slots[chunk.state_slot] == full[:computed], "state slot does not summarise the prefix"
            for pos in range(computed):
                page = chunk.page_ids[pos // self.page_size]
                assert self.pages[page].get(pos % self.page_size) == full[pos], f"KV wrong at {pos}"
            assert token_ids == full[computed : computed + len(token_ids)]
            for i, tok in enumerate(token_ids):
                pos = computed + i
                self.pages[chunk.page_ids[pos // self.page_size]][pos % self.page_size] = tok
            if chunk.snapshot_slot is not None:
                # A checkpoint inside the chunk: the state and logits after its first snapshot_tokens.
                assert 0 < chunk.snapshot_tokens < len(token_ids) and chunk.previous_row is None
                self.slots[chunk.snapshot_slot] = full[: computed + chunk.snapshot_tokens]
                self.slot_logits[chunk.snapshot_slot] = list(self.slots[chunk.snapshot_slot])
            self.slots[chunk.state_slot] = full[: computed + len(token_ids)]
            if chunk.compute_logits and token_ids:
                self.slot_logits[chunk.state_slot] = list(self.slots[chunk.state_slot])
            if chunk.sample:
                logits_of = self.slot_logits[chunk.state_slot]
                assert logits_of == full[: computed + len(token_ids)], "sampling from stale logits"
                sampled_by_row[row] = next_token(logits_of)
        self.sampled_by_row = sampled_by_row
        return {step.chunks[row].request_id: token for row, token in sampled_by_row.items()}


@pytest.fixture(params=[False, True], ids=["sync", "overlap"], autouse=True)
def decode_overlap(request, monkeypatch):
    monkeypatch.setattr(Harness, "overlap", request.param)
    return request.param


class Harness:
    overlap = False  # set per test by the decode_overlap fixture

    def __init__(
        self,
        byte_tokenizer,
        *,
        max_concurrency: int = 2,
        kv_tokens: int = 512,
        page_size: int = 8,
        extra_slots: int = 2,
        prefill_chunk: int = 16,
        mixed_prefill_chunk: int = 8,
        max_context: int = 256,
        hybrid: bool = True,
        prefix_reuse: bool = True,
        host_slots: int = 0,
        limits: CacheLimits | None = None,
        host_kv_pages: int = 0,
        planner_rates: tuple[ContextCosts, int, int] | None = None,  # costs, state bytes, KV page bytes
    ):
        self.now = 0.0
        num_pages = kv_tokens // page_size
        num_slots = max_concurrency + extra_slots
        self.kv_pool = KVPool(num_pages, page_size)
        self.state_pool = StatePool(num_slots)
        self.host_pool = StatePool(host_slots)
        self.host_kv_pool = KVPool(host_kv_pages, page_size) if host_kv_pages else None
        self.cache = ContextCache(
            self.kv_pool, self.state_pool, exact_frontier_only=hybrid, enabled=prefix_reuse, host_pool=self.host_pool,
            limits=limits or CacheLimits(),
            host_kv_pool=self.host_kv_pool,
        )
        costs, state_bytes, page_bytes = planner_rates or (None, 0, 0)
        self.scheduler = Scheduler(
            SchedulerLimits(max_concurrency, max_context, prefill_chunk, prefix_reuse, mixed_prefill_chunk),
            self.kv_pool,
            self.state_pool,
            self.cache,
            make_stop_checker=lambda r: StopChecker(byte_tokenizer, r.stop_token_ids, r.stop_strings),
            clock=lambda: self.now,
            costs=costs,
            state_image_bytes=state_bytes,
            kv_page_bytes=page_bytes,
        )
        self.runner = FakeRunner(num_pages, page_size, num_slots, recurrent=hybrid, num_host_slots=host_slots)
        self.outputs: dict[str, list[EngineOutput]] = {}
        self.steps: list[SchedulerStep] = []
        self.inflight: tuple[SchedulerStep, dict[str, int]] | None = None  # launched ahead, not committed

    def add(self, request: EngineRequest) -> None:
        err = self.scheduler.add(request)
        self.outputs.setdefault(request.request_id, [])
        if err is not None:
            self.outputs[request.request_id].append(err)

    def _launch(self, step: SchedulerStep) -> tuple[SchedulerStep, dict[str, int]]:
        histories = {s.request_id: list(s.token_ids) for s in self.scheduler.running}
        return step, self.runner.execute(step, histories)

    def step(self) -> SchedulerStep | None:
        """Commit one step (as EngineCore.step: with overlap, launch the next one first)."""
        current, self.inflight = self.inflight, None
        if current is None:
            step = self.scheduler.schedule()
            if step is None:
                self._record(self.scheduler.take_pending_outputs())
                return None
            current = self._launch(step)
        if self.overlap:
            ahead = self.scheduler.schedule_ahead(current[0])
            if ahead is not None:
                self.inflight = self._launch(ahead)
        step, sampled = current
        self._record(self.scheduler.update(step, sampled))
        self.steps.append(step)
        self.now += 0.01
        return step

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.inflight is not None

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.has_work:
                self._record(self.scheduler.take_pending_outputs())
                return
            self.step()
        raise AssertionError("did not finish")

    def _record(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            self.outputs.setdefault(out.request_id, []).append(out)

    def final(self, request_id: str) -> EngineOutput:
        finals = [o for o in self.outputs[request_id] if o.finished]
        assert len(finals) == 1, f"{request_id}: {len(finals)} terminal outputs"
        return finals[0]

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs[request_id] for t in o.new_token_ids]

    def text(self, request_id: str) -> str:
        return "".join(o.text for o in self.outputs[request_id])

    def assert_balanced(self) -> None:
        """Every page and slot is owned by a running request or a checkpoint, or is free."""
        self.kv_pool.check_balanced()
        self.state_pool.check_balanced()
        self.host_pool.check_balanced()
        if self.host_kv_pool is not None:
            self.host_kv_pool.check_balanced()
            held = [p for ck in self.cache.checkpoints.values() for p in ck.host_pages or []]
            assert len(held) == len(set(held)) == self.host_kv_pool.num_used  # each host page has one owner
        expected_refs: dict[int, int] = {}
        owners = [*self.scheduler.running, *self.scheduler.draining]
        for seq in owners:
            for p in seq.pages:
                expected_refs[p] = expected_refs.get(p, 0) + 1
        for ck in self.cache.checkpoints.values():
            for p in ck.pages:
                expected_refs[p] = expected_refs.get(p, 0) + 1
        for page in range(self.kv_pool.num_pages):
            assert self.kv_pool.refcount(page) == expected_refs.get(page, 0), f"page {page} refcount"
        checkpoints = list(self.cache.checkpoints.values())
        for ck in checkpoints:  # each StateImage lives in exactly one tier
            assert (ck.state_slot is None) != (ck.host_slot is None), f"checkpoint {ck.checkpoint_id} placement"
        on_device = [c.state_slot for c in checkpoints if c.state_slot is not None]
        owned = {s.state_slot for s in owners} | set(on_device)
        assert len(owned) == len(owners) + len(on_device)  # no slot owned twice
        assert self.state_pool.num_free == self.state_pool.num_slots - len(owned)
        on_host = {c.host_slot for c in checkpoints if c.host_slot is not None}
        assert len(on_host) == len(checkpoints) - len(on_device)
        assert self.host_pool.num_free == self.host_pool.num_slots - len(on_host)

    def assert_empty(self) -> None:
        self.cache.clear()
        self.assert_balanced()
        assert self.kv_pool.num_free == self.kv_pool.num_pages
        assert self.state_pool.num_free == self.state_pool.num_slots
        assert self.host_pool.num_free == self.host_pool.num_slots
        assert self.host_kv_pool is None or self.host_kv_pool.num_free == self.host_kv_pool.num_pages


def req(request_id: str, prompt: list[int], max_new: int = 8, **kw) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(temperature=0.0), max_new_tokens=max_new, **kw)


def expected_continuation(prompt: list[int], num_tokens: int) -> list[int]:
    history = list(prompt)
    for _ in range(num_tokens):
        history.append(next_token(history))
    return history[len(prompt) :]


PROMPT = [ord(c) for c in "The quick brown fox jumps over the lazy dog, again and again."]


def test_single_request_chunks_then_decodes(byte_tokenizer):
    h = Harness(byte_tokenizer, prefill_chunk=16)
    h.add(req("a", PROMPT, max_new=5))
    h.run()
    kinds = [s.kind for s in h.steps if s.chunks]
    chunk_sizes = [s.num_tokens for s in h.steps if s.kind is StepKind.PREFILL]
    assert chunk_sizes == [16, 16, 16, len(PROMPT) - 48]
    assert kinds[4:] == [StepKind.DECODE] * 4  # the 5th token comes from the 4th decode round
    final = h.final("a")
    assert final.finish_reason is FinishReason.LENGTH
    assert h.tokens("a") == expected_continuation(PROMPT, 5)
    assert final.completion_tokens == 5 and final.prompt_tokens == len(PROMPT) and final.cached_tokens == 0
    h.assert_balanced()
    h.assert_empty()


def test_progress_events_monotonic_and_complete(byte_tokenizer):
    h = Harness(byte_tokenizer, prefill_chunk=20)
    h.add(req("a", PROMPT, max_new=2))
    h.run()
    progress = [o.progress for o in h.outputs["a"] if o.progress is not None]
    assert progress[0].processed == progress[0].cache == 0
    assert [p.processed for p in progress] == [0, 20, 40, 60, len(PROMPT)]
    assert progress[-1].processed == progress[-1].total == len(PROMPT)
    first_token_out = next(o for o in h.outputs["a"] if o.new_token_ids)
    assert first_token_out.progress is not None and first_token_out.progress.processed == len(PROMPT)


def test_decode_rows_ride_with_every_prompt_chunk(byte_tokenizer):
    h = Harness(byte_tokenizer, prefill_chunk=32, mixed_prefill_chunk=8, max_concurrency=2)
    h.add(req("a", PROMPT[:10], max_new=30))
    for _ in range(3):
        h.step()  # a is decoding now
    h.add(req("b", PROMPT * 2, max_new=3))
    h.run()
    first_b = next(i for i, s in enumerate(h.steps) if any(c.request_id == "b" for c in s.chunks))
    b_prompt_steps = [s for s in h.steps[first_b:] if s.kind is StepKind.MIXED]
    b_chunk_sizes = []
    for step in b_prompt_steps:
        rows = {c.request_id: c for c in step.chunks}
        assert len(rows["a"].token_ids) == 1 and rows["a"].sample  # a decodes in every step of b's prompt
        b_chunk_sizes.append(len(rows["b"].token_ids))
    # b's whole uncached prompt, in chunks of the mixed budget less a's decode row
    assert sum(b_chunk_sizes) == len(PROMPT * 2) - h.final("b").cached_tokens
    assert max(b_chunk_sizes) == 7 and len(b_chunk_sizes) == -(-sum(b_chunk_sizes) // 7)
    assert h.tokens("a") == expected_continuation(PROMPT[:10], 30)
    assert h.tokens("b") == expected_continuation(PROMPT * 2, 3)
    decode_with_both = [s for s in h.steps if s.kind is StepKind.DECODE and len(s.chunks) == 2]
    assert decode_with_both, "b joins a's decode batch after its prefill"
    h.assert_empty()


def test_step_budgets_and_fifo_order_of_prompt_work(byte_tokenizer):
    """A burst: prompt work goes to the earliest admitted request first, several requests' chunks
    share a step up to the budget, and once one decodes every step carries its row."""
    h = Harness(byte_tokenizer, prefill_chunk=40, mixed_prefill_chunk=12, max_concurrency=3, kv_tokens=1024)
    prompts = {"a": PROMPT[:30], "b": PROMPT[:50], "c": PROMPT[:45]}
    for rid, prompt in prompts.items():
        h.add(req(rid, prompt, max_new=6))
    h.run()
    computed = {rid: 0 for rid in prompts}
    sampled = {rid: 0 for rid in prompts}
    for step in h.steps:
        prompt_rows = [c for c in step.chunks if c.num_computed_tokens < len(prompts[c.request_id])]
        decode_rows = [c for c in step.chunks if c not in prompt_rows]
        num_prompt_tokens = sum(len(c.token_ids) for c in prompt_rows)
        decoding = {rid for rid in prompts if computed[rid] == len(prompts[rid]) and sampled[rid] < 6}
        assert {c.request_id for c in decode_rows} == decoding, "every decoding request has a row"
        num_decode_tokens = sum(len(c.token_ids) for c in decode_rows)
        if decode_rows:  # the mixed budget counts the decode rows' tokens too
            assert num_prompt_tokens + num_decode_tokens <= 12
        else:
            assert num_prompt_tokens <= 40
        # FIFO: a later request gets prompt tokens only when every earlier one finishes its prompt here.
        for chunk in prompt_rows[:-1]:
            assert chunk.num_computed_tokens + len(chunk.token_ids) == len(prompts[chunk.request_id])
        order = [c.request_id for c in prompt_rows]
        assert order == sorted(order)
        for chunk in prompt_rows:
            computed[chunk.request_id] += len(chunk.token_ids)
        for chunk in step.chunks:
            sampled[chunk.request_id] += chunk.sample
    assert [s.kind for s in h.steps[:2]] == [StepKind.PREFILL, StepKind.MIXED]
    assert [c.request_id for c in h.steps[0].chunks] == ["a", "b"]  # 30 + 10 tokens in one forward
    for rid, prompt in prompts.items():
        assert h.tokens(rid) == expected_continuation(prompt, 6)  # as if each ran alone
    h.assert_balanced()
    h.assert_empty()


def test_a_full_mixed_step_holds_the_budget_with_its_decode_rows(byte_tokenizer):
    """Beside decode rows the budget counts them: while a prompt has enough left, each mixed step
    holds exactly mixed_prefill_chunk tokens (a power of two fills its step graph's bucket)."""
    h = Harness(byte_tokenizer, prefill_chunk=64, mixed_prefill_chunk=16, max_concurrency=4, kv_tokens=2048)
    for rid in ("a", "b", "c"):
        h.add(req(rid, PROMPT[:12], max_new=60))
    for _ in range(4):
        h.step()  # a, b and c decode now
    h.add(req("d", PROMPT * 3, max_new=2))
    h.run()
    mixed = [s for s in h.steps if s.kind is StepKind.MIXED]
    sizes = [sum(len(c.token_ids) for c in s.chunks) for s in mixed]
    prompt_sizes = [sum(len(c.token_ids) for c in s.chunks if c.request_id == "d") for s in mixed]
    assert len(mixed) >= 3 and all(len(s.chunks) == 4 for s in mixed)
    assert sizes[:-1] == [16] * (len(sizes) - 1) and sizes[-1] <= 16  # the last one: d's remainder
    assert prompt_sizes[:-1] == [13] * (len(sizes) - 1)
    assert h.tokens("d") == expected_continuation(PROMPT * 3, 2)
    h.assert_empty()


def test_the_mixed_prompt_budget_keeps_half_for_prompt_tokens():
    limits = SchedulerLimits(max_concurrency=8, max_context=4096, prefill_chunk=8192, mixed_prefill_chunk=1024)
    assert limits.mixed_prompt_budget(0) == 1024
    assert limits.mixed_prompt_budget(8) == 1016
    assert limits.mixed_prompt_budget(32) == 992  # 8 verification rows of 4 tokens
    assert limits.mixed_prompt_budget(600) == 512  # never below half: prompts are not starved
    small = SchedulerLimits(max_concurrency=8, max_context=4096, prefill_chunk=8192, mixed_prefill_chunk=1)
    assert small.mixed_prompt_budget(8) == 1


def test_fifo_admission_never_overcommits_kv(byte_tokenizer):
    # 64 KV tokens: a reserves 40 + 20 = 60 -> b (30 + 10) must wait for a, c waits behind b.
    h = Harness(byte_tokenizer, kv_tokens=64, page_size=4, max_concurrency=3, prefix_reuse=False)
    h.add(req("a", PROMPT[:40], max_new=20))
    h.add(req("b", PROMPT[:30], max_new=10))
    h.add(req("c", PROMPT[:4], max_new=2))
    admitted_order = []
    while h.has_work:
        h.step()
        for seq in h.scheduler.running:
            if seq.request_id not in admitted_order:
                admitted_order.append(seq.request_id)
        reserved = sum(len(s.pages) for s in h.scheduler.running)
        assert reserved <= h.kv_pool.num_pages
        h.assert_balanced()
    assert admitted_order == ["a", "b", "c"]
    first_b_step = next(i for i, s in enumerate(h.steps) if any(c.request_id == "b" for c in s.chunks))
    a_done_step = max(i for i, s in enumerate(h.steps) if any(c.request_id == "a" for c in s.chunks))
    assert first_b_step > a_done_step
    for rid, n in (("a", 20), ("b", 10), ("c", 2)):
        assert h.final(rid).completion_tokens == n
    h.assert_empty()


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding"])
def test_cancel_frees_everything(byte_tokenizer, when):
    h = Harness(byte_tokenizer, max_concurrency=1, prefill_chunk=8)
    h.add(req("a", PROMPT, max_new=50))
    h.add(req("b", PROMPT[:20], max_new=50))
    target = {"waiting": "b", "prefilling": "a", "decoding": "a"}[when]
    steps = {"waiting": 1, "prefilling": 2, "decoding": 12}[when]
    for _ in range(steps):
        h.step()
    out = h.scheduler.abort(target)
    assert out is not None and out.finish_reason is FinishReason.CANCELLED
    h._record([out])
    h.assert_balanced()
    h.run()
    assert h.final(target).finish_reason is FinishReason.CANCELLED
    h.assert_balanced()
    h.assert_empty()


def test_stop_token_and_stop_string(byte_tokenizer):
    h = Harness(byte_tokenizer)
    expected = expected_continuation(PROMPT, 40)
    stop_tok = expected[6]
    h.add(req("tok", PROMPT, max_new=40, stop_token_ids=[stop_tok]))
    text = bytes(expected).decode()
    stop_str = text[10:13]
    first = text.find(stop_str)
    h.add(req("str", PROMPT, max_new=40, stop_strings=["zzzz-never", stop_str]))
    h.run()
    out = h.final("tok")
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop_tok
    n = expected.index(stop_tok) + 1
    assert h.tokens("tok") == expected[:n]
    assert h.text("tok") == bytes(expected[: n - 1]).decode()  # the stop token's text is withheld
    out = h.final("str")
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop_str
    assert h.text("str") == text[:first]
    assert h.tokens("str") == expected[: first + len(stop_str)]  # committed up to the completing token
    h.assert_empty()


def test_overlap_runs_steady_decode_ahead(byte_tokenizer, decode_overlap):
    h = Harness(byte_tokenizer, max_concurrency=2)
    h.add(req("a", PROMPT[:20], max_new=12))
    h.add(req("b", PROMPT[:30], max_new=9))
    h.run()
    assert h.tokens("a") == expected_continuation(PROMPT[:20], 12)
    assert h.tokens("b") == expected_continuation(PROMPT[:30], 9)
    chained = [any(c.previous_row is not None for c in s.chunks) for s in h.steps]
    # a's first chunk; a's last chunk with b's first (a samples); a decoding beside b's prompt
    # until b samples; then a and b decode: a round is planned ahead from the second one on.
    kinds_and_rows = [(s.kind, [c.request_id for c in s.chunks]) for s in h.steps]
    assert [kind for kind, _ in kinds_and_rows[:5]] == [StepKind.PREFILL] * 2 + [StepKind.MIXED] * 3
    assert [s.num_tokens for s in h.steps[:5]] == [16, 4 + 12, 1 + 7, 1 + 7, 1 + 4]  # mixed: 8 in all
    both = kinds_and_rows.index((StepKind.DECODE, ["a", "b"]))
    assert both == 5 and all(kind is StepKind.DECODE for kind, _ in kinds_and_rows[both:])
    assert chained == [False] * (both + 1) + [True] * (len(h.steps) - both - 1) if decode_overlap else not any(chained)
    if decode_overlap:
        for step in h.steps[both + 1 :]:
            assert all(c.token_ids == [PENDING_TOKEN] and c.previous_row == row for row, c in enumerate(step.chunks))
        assert [len(s.chunks) for s in h.steps[both:]] == [2] * 8  # b: 1 + 8 tokens, a: 4 + 8
    h.assert_empty()


def test_overlap_stop_lands_the_extra_token_in_the_endpoint(byte_tokenizer, decode_overlap):
    # A stop token ends the request while the next round (planned ahead) computes it. Its
    # pages and slot are released or kept only when that round lands; the endpoint
    # checkpoint then includes the stop token, and a next turn resumes from it exactly.
    h = Harness(byte_tokenizer, max_concurrency=1)
    expected = expected_continuation(PROMPT, 40)
    stop_tok = expected[6]
    n = expected.index(stop_tok) + 1
    h.add(req("a", PROMPT, max_new=40, stop_token_ids=[stop_tok]))
    while not any(o.finished for o in h.outputs["a"]):
        h.step()
    assert h.tokens("a") == expected[:n]
    if decode_overlap:
        assert [s.request_id for s in h.scheduler.draining] == ["a"]
        assert [len(c.token_ids) for c in h.cache.checkpoints.values()] == [len(PROMPT)]  # the prompt's only
        h.assert_balanced()
    h.run()
    assert h.scheduler.draining == []
    endpoint = max(h.cache.checkpoints.values(), key=lambda c: c.frontier)
    committed = PROMPT + expected[:n]
    assert endpoint.token_ids == (committed if decode_overlap else committed[:-1])
    follow_up = committed + [ord(c) for c in " More."]
    h.add(req("b", follow_up, max_new=6))
    h.run()
    assert h.final("b").cached_tokens == endpoint.frontier
    assert h.tokens("b") == expected_continuation(follow_up, 6)
    h.assert_empty()


def test_overlap_cancel_while_a_round_is_ahead(byte_tokenizer, decode_overlap):
    h = Harness(byte_tokenizer, max_concurrency=2)
    h.add(req("a", PROMPT[:12], max_new=30))
    h.add(req("b", PROMPT[:14], max_new=30))
    for _ in range(8):
        h.step()
    assert (h.inflight is not None) == decode_overlap
    out = h.scheduler.abort("a")
    h._record([out])
    assert out.finish_reason is FinishReason.CANCELLED
    assert [s.request_id for s in h.scheduler.draining] == (["a"] if decode_overlap else [])
    h.assert_balanced()
    h.run()
    assert h.tokens("b") == expected_continuation(PROMPT[:14], 30)
    assert h.tokens("a") == expected_continuation(PROMPT[:12], len(h.tokens("a")))
    h.assert_empty()


def _decode_round_in_flight(h: Harness) -> SchedulerStep:
    """Step until a decode round of every running request (each already past its first
    decode) is scheduled; -> that round, launched but not updated."""
    while True:
        step = h.scheduler.schedule()
        steady = all(s.num_output_tokens >= 2 and not s.is_prefilling for s in h.scheduler.running)
        launched = h._launch(step)
        if step.kind is StepKind.DECODE and steady:
            return launched
        h.scheduler.update(*launched)


@pytest.mark.parametrize(
    "blocker",
    ["none", "waiting_behind_full_lanes", "waiting_for_a_free_lane", "penalties", "thinking_cap", "prefilling",
     "all_at_output_limit"],
)
def test_schedule_ahead_only_in_steady_decode(byte_tokenizer, blocker):
    lanes = 2 if blocker == "waiting_behind_full_lanes" else 3
    h = Harness(byte_tokenizer, max_concurrency=lanes, prefill_chunk=8)
    h.add(req("a", PROMPT[:10], max_new=20))
    if blocker == "penalties":
        h.add(EngineRequest("b", PROMPT[:12], SamplingParams(temperature=0.0, presence_penalty=0.5), max_new_tokens=20))
    elif blocker == "thinking_cap":
        budget = ThinkingBudget(max_thinking_tokens=50, close_token_ids=[ord("!")], think_end_token_id=255)
        h.add(req("b", PROMPT[:12], max_new=20, thinking_budget=budget))
    else:
        h.add(req("b", PROMPT[:12], max_new=20))
    inflight, sampled = _decode_round_in_flight(h)
    running = {s.request_id: s for s in h.scheduler.running}
    if blocker == "thinking_cap":
        running["b"].num_thinking_tokens = 49  # the round's token reaches the cap: close tokens follow
    if blocker == "all_at_output_limit":
        for seq in running.values():
            seq.max_new_tokens = seq.num_output_tokens + 1  # the round's token is each one's last
    if blocker.startswith("waiting"):
        h.add(req("c", PROMPT[:5], max_new=2))  # admitted at the next schedule() only if a lane is free
    if blocker == "prefilling":
        h.scheduler.update(inflight, sampled)
        h.add(req("c", PROMPT, max_new=2))
        inflight = h.scheduler.schedule()  # c admitted: its first chunk rides with a's and b's rows
        assert inflight.kind is StepKind.MIXED and [c.request_id for c in inflight.chunks] == ["a", "b", "c"]
    ahead = h.scheduler.schedule_ahead(inflight)
    if blocker not in ("none", "waiting_behind_full_lanes", "penalties"):
        assert ahead is None
        return
    assert [(c.request_id, c.previous_row, c.token_ids) for c in ahead.chunks] == [
        ("a", 0, [PENDING_TOKEN]), ("b", 1, [PENDING_TOKEN])
    ]
    for chunk, before in zip(ahead.chunks, inflight.chunks):
        assert chunk.num_computed_tokens == before.num_computed_tokens + 1
        assert chunk.num_generated == before.num_generated + 1
        assert chunk.page_ids == before.page_ids and chunk.state_slot == before.state_slot
    # A penalised row runs ahead with its committed output; the runner counts the token in flight.
    b = running["b"]
    expected_history = list(b.token_ids[b.prompt_len :]) if blocker == "penalties" else []
    assert list(ahead.chunks[1].output_token_ids) == expected_history and ahead.chunks[0].output_token_ids == []
    if blocker == "penalties":
        assert expected_history and len(expected_history) == inflight.chunks[1].num_generated


def test_max_new_tokens_zero_processes_prompt_only(byte_tokenizer):
    h = Harness(byte_tokenizer)
    h.add(req("a", PROMPT, max_new=0))
    h.run()
    out = h.final("a")
    assert out.finish_reason is FinishReason.LENGTH and out.completion_tokens == 0
    assert h.tokens("a") == []
    assert all(s.kind is StepKind.PREFILL for s in h.steps if s.chunks)
    h.assert_empty()


def test_endpoint_reuse_is_exact_and_output_identical(byte_tokenizer):
    h = Harness(byte_tokenizer)
    h.add(req("t1", PROMPT, max_new=6))
    h.run()
    turn1 = h.tokens("t1")
    frontier = len(PROMPT) + len(turn1) - 1  # the last sampled token was never computed
    follow = PROMPT + turn1 + [ord(c) for c in " And next?"]
    h.add(req("t2", follow, max_new=6))
    h.run()
    out = h.final("t2")
    assert out.cached_tokens == frontier and out.reuse_path == "private_endpoint"
    assert h.tokens("t2") == expected_continuation(follow, 6)
    # the same conversation without reuse gives the same tokens
    h2 = Harness(byte_tokenizer, prefix_reuse=False)
    h2.add(req("t2", follow, max_new=6))
    h2.run()
    assert h2.tokens("t2") == h.tokens("t2") and h2.final("t2").cached_tokens == 0
    h.assert_balanced()
    h.assert_empty()


def test_prompt_end_capture_serves_a_divergent_continuation(byte_tokenizer):
    h = Harness(byte_tokenizer)
    h.add(req("t1", PROMPT, max_new=4))
    h.run()
    follow = PROMPT + [ord(c) for c in " (edited reply) then more"]
    h.add(req("t2", follow, max_new=3))
    h.run()
    assert h.final("t2").cached_tokens == len(PROMPT)
    assert h.tokens("t2") == expected_continuation(follow, 3)
    h.assert_empty()


def test_full_prompt_hit_samples_from_stored_logits(byte_tokenizer):
    h = Harness(byte_tokenizer)
    h.add(req("a", PROMPT, max_new=3))
    h.run()
    h.add(req("b", PROMPT, max_new=3))
    h.run()
    out = h.final("b")
    assert out.cached_tokens == len(PROMPT)
    assert h.tokens("b") == h.tokens("a")
    progress = [o.progress for o in h.outputs["b"] if o.progress]
    assert progress[0].cache == progress[0].processed == progress[0].total == len(PROMPT)
    assert not any(s.kind is StepKind.PREFILL and s.chunks[0].request_id == "b" for s in h.steps)
    h.assert_empty()


def test_capture_hint_inside_prompt_and_partial_page_copy(byte_tokenizer):
    # frontier 21 is mid-page (page size 8): a resumer must copy page 2 before writing.
    h = Harness(byte_tokenizer, page_size=8, prefill_chunk=16)
    h.add(req("a", PROMPT, max_new=2, capture_hints=[CaptureHint(21, "shared_stable_prefix")]))
    h.run()
    prefill = [s.chunks[0] for s in h.steps if s.kind is StepKind.PREFILL]
    # The chunk goes on past the frontier, which it snapshots inside the step.
    assert [len(c.token_ids) for c in prefill[:2]] == [16, 16]
    assert prefill[1].snapshot_tokens == 5 and prefill[1].snapshot_slot is not None
    other = PROMPT[:21] + [ord(c) for c in "completely different"]
    h.add(req("b", other, max_new=4))
    h.run()
    out = h.final("b")
    assert out.cached_tokens == 21 and out.reuse_path == "shared_stable_prefix"
    assert h.tokens("b") == expected_continuation(other, 4)
    assert any(isinstance(a, CopyPage) for s in h.steps for a in s.before)
    h.assert_empty()


def test_beside_decode_rows_a_frontier_near_the_chunk_end_ends_the_chunk(byte_tokenizer):
    """A checkpoint inside a mixed step would cost every decoding stream the rule's second
    pass: with few of the chunk's tokens after it, the chunk ends at the frontier and the rest
    rides in the next step; the checkpoint is kept as well, and serves the next turn."""
    from ninfer.engine.scheduler.chunks import MIN_TOKENS_AFTER_SNAPSHOT_BESIDE_DECODE as MIN_AFTER

    h = Harness(byte_tokenizer, prefill_chunk=512, mixed_prefill_chunk=512, max_concurrency=2, kv_tokens=4096,
                max_context=1024)
    h.add(req("a", PROMPT[:10], max_new=40))
    for _ in range(3):
        h.step()  # a decodes now
    prompt = [ord("#")] + (PROMPT * 5)[:299]  # nothing to reuse from a
    closure = len(prompt) - 6  # a chat's turn closure, a few tokens before the prompt's end
    h.add(req("b", prompt, max_new=2, capture_hints=[CaptureHint(closure, "private_turn_closure")]))
    h.run()
    b_chunks = [c for s in h.steps for c in s.chunks if c.request_id == "b" and c.num_computed_tokens < len(prompt)]
    assert [(c.num_computed_tokens, len(c.token_ids), c.snapshot_slot) for c in b_chunks] == [
        (0, closure, None), (closure, 6, None)]
    assert closure in {ck.frontier for ck in h.cache.checkpoints.values()}
    assert h.tokens("b") == expected_continuation(prompt, 2)
    # A frontier with enough of the chunk after it is still snapshotted inside the mixed step.
    early = MIN_AFTER + 20
    prompt = [ord("%")] + prompt[1:]  # nothing to reuse from b
    h.add(req("c", prompt, max_new=2, capture_hints=[CaptureHint(len(prompt) - early, "shared_stable_prefix")]))
    h.add(req("d", PROMPT[:10], max_new=30))  # so that c's prompt runs beside a decode row
    h.run()
    c_chunks = [c for s in h.steps for c in s.chunks if c.request_id == "c" and c.num_computed_tokens < len(prompt)]
    assert any(c.snapshot_slot is not None and len(c.token_ids) - c.snapshot_tokens >= MIN_AFTER for c in c_chunks)
    h.assert_empty()


def test_a_snapshot_slot_is_given_back_when_its_step_fails_and_kept_when_its_request_ends(byte_tokenizer):
    h = Harness(byte_tokenizer, max_concurrency=1, prefill_chunk=64)
    hint = [CaptureHint(30, "private_turn_closure")]
    h.add(req("a", PROMPT, max_new=3, capture_hints=hint))
    step = h.scheduler.schedule()
    assert step.chunks[0].snapshot_tokens == 30 and step.chunks[0].snapshot_slot is not None
    h._record(h.scheduler.fail_steps([step], "simulated device fault"))
    assert h.final("a").error is not None and len(h.cache) == 0
    h.assert_empty()
    # Cancelled while its step runs: the step still lands, and what it computed is kept.
    h.add(req("b", PROMPT, max_new=3, capture_hints=hint))
    step, sampled = h._launch(h.scheduler.schedule())
    h._record([h.scheduler.abort("b")])
    h._record(h.scheduler.update(step, sampled))
    h.assert_balanced()
    assert 30 in {ck.frontier for ck in h.cache.checkpoints.values()}
    h.add(req("c", PROMPT[:30] + [ord("?")], max_new=2))  # and it serves: the FakeRunner checks the state
    h.run()
    assert h.final("c").cached_tokens == 30 and h.tokens("c") == expected_continuation(PROMPT[:30] + [ord("?")], 2)
    h.assert_empty()


def test_attention_only_models_reuse_any_common_prefix(byte_tokenizer):
    h = Harness(byte_tokenizer, hybrid=False)
    h.add(req("a", PROMPT, max_new=2))
    h.run()
    other = PROMPT[:30] + [ord(c) for c in "XYZ diverges here"]
    h.add(req("b", other, max_new=3))
    h.run()
    assert h.final("b").cached_tokens == 30
    assert h.tokens("b") == expected_continuation(other, 3)
    h.assert_empty()


def test_hybrid_models_reuse_only_at_frontiers(byte_tokenizer):
    h = Harness(byte_tokenizer, hybrid=True)
    h.add(req("a", PROMPT, max_new=2))
    h.run()
    other = PROMPT[:30] + [ord(c) for c in "XYZ diverges here"]
    h.add(req("b", other, max_new=3))
    h.run()
    assert h.final("b").cached_tokens == 0 and h.final("b").reuse_path == "root"
    h.assert_empty()


def test_lru_eviction_under_slot_pressure(byte_tokenizer):
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=1)
    prompts = {f"r{i}": [ord(c) for c in f"conversation number {i} " * 3] for i in range(4)}
    for rid, prompt in prompts.items():
        h.add(req(rid, prompt, max_new=3))
        h.run()
        h.assert_balanced()
        assert len(h.cache) <= h.state_pool.num_slots
    # the newest conversation is still resumable, the oldest was evicted
    newest = prompts["r3"] + h.tokens("r3") + [ord("!")]
    oldest = prompts["r0"] + h.tokens("r0") + [ord("!")]
    h.add(req("n", newest, max_new=2))
    h.add(req("o", oldest, max_new=2))
    h.run()
    assert h.final("n").cached_tokens > 0
    assert h.final("o").cached_tokens == 0
    h.assert_empty()


def test_no_free_slot_adopts_the_checkpoint(byte_tokenizer):
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=0)
    h.add(req("a", PROMPT, max_new=3))
    h.run()
    follow = PROMPT + h.tokens("a") + [ord("?")]
    h.add(req("b", follow, max_new=3))
    h.run()
    assert h.final("b").cached_tokens == len(PROMPT) + 2
    assert h.tokens("b") == expected_continuation(follow, 3)
    h.assert_empty()


def _turn_closure_conversation(h: Harness) -> tuple[list[int], int]:
    """One turn with a turn-closure hint, then the next turn's prompt, which re-renders the
    closed turn differently (as Qwen's template drops reasoning): -> (next prompt, frontier)."""
    opener = [ord(c) for c in "<assistant>"]
    prompt = PROMPT + opener + [ord(c) for c in "<think>"]  # the generation prologue opens reasoning
    frontier = len(PROMPT)  # before the open turn's assistant opener
    h.add(req("t1", prompt, max_new=5, capture_hints=[CaptureHint(frontier, "private_turn_closure")]))
    h.run()
    rerendered = opener + [ord(c) for c in "answer without its reasoning</assistant><user>next?"]
    return PROMPT + rerendered, frontier


def test_turn_closure_survives_at_one_lane_through_the_host_tier(byte_tokenizer):
    # The defaults at --max-concurrency 1: two device slots, so the prompt-end capture and the
    # endpoint push the turn-closure checkpoint out of the device; it spills to the host.
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=1, host_slots=8)
    follow, frontier = _turn_closure_conversation(h)
    assert any(isinstance(a, SpillSlot) for s in h.steps for a in s.before)
    assert sum(ck.on_host for ck in h.cache.checkpoints.values()) == 1
    h.assert_balanced()
    h.add(req("t2", follow, max_new=6))
    h.run()
    out = h.final("t2")
    assert out.cached_tokens == frontier and out.reuse_path == "private_turn_closure"
    assert any(isinstance(a, RestoreSlot) for s in h.steps for a in s.before)
    assert h.tokens("t2") == expected_continuation(follow, 6)  # the FakeRunner checked the restored state
    h.assert_balanced()
    h.assert_empty()


def test_without_a_host_tier_the_turn_closure_is_dropped(byte_tokenizer):
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=1, host_slots=0)
    follow, _ = _turn_closure_conversation(h)
    h.add(req("t2", follow, max_new=6))
    h.run()
    assert h.final("t2").cached_tokens == 0
    assert h.tokens("t2") == expected_continuation(follow, 6)
    h.assert_empty()


def test_full_prompt_hit_restored_from_the_host_samples_its_stored_logits(byte_tokenizer):
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=1, host_slots=4)
    h.add(req("a", PROMPT, max_new=3))
    h.run()
    for i in range(2):  # later conversations push PROMPT's checkpoints to the host
        h.add(req(f"x{i}", [ord(c) for c in f"another conversation {i} " * 2], max_new=2))
        h.run()
    assert any(ck.on_host and ck.frontier == len(PROMPT) for ck in h.cache.checkpoints.values())
    h.add(req("b", PROMPT, max_new=3))
    h.run()
    assert h.final("b").cached_tokens == len(PROMPT)
    assert h.tokens("b") == h.tokens("a")
    assert not any(s.kind is StepKind.PREFILL and s.chunks[0].request_id == "b" for s in h.steps)
    h.assert_empty()


def test_a_full_host_tier_drops_its_least_recently_used(byte_tokenizer):
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=1, host_slots=2)
    prompts = {f"r{i}": [ord(c) for c in f"conversation number {i} " * 3] for i in range(5)}
    for rid, prompt in prompts.items():
        h.add(req(rid, prompt, max_new=3))
        h.run()
        h.assert_balanced()
        assert len(h.cache) <= h.state_pool.num_slots + h.host_pool.num_slots
    assert h.host_pool.num_free == 0
    newest = prompts["r4"] + h.tokens("r4") + [ord("!")]
    oldest = prompts["r0"] + h.tokens("r0") + [ord("!")]
    h.add(req("n", newest, max_new=2))
    h.add(req("o", oldest, max_new=2))
    h.run()
    assert h.final("n").cached_tokens > 0
    assert h.final("o").cached_tokens == 0
    assert h.tokens("n") == expected_continuation(newest, 2) and h.tokens("o") == expected_continuation(oldest, 2)
    h.assert_empty()


def _conversation(label: str) -> list[int]:
    return [ord(c) for c in f"conversation {label} says hello " * 2]


def _next_turn(h: Harness, request_id: str, prompt: list[int]) -> list[int]:
    return prompt + h.tokens(request_id) + [ord("!")]


def test_a_newcomer_beyond_the_continuation_limit_is_kept_and_the_least_likely_to_return_gives_way(byte_tokenizer):
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=4, limits=CacheLimits(max_private_continuations=2))
    a1, b1 = _conversation("a"), _conversation("b")
    h.add(req("a1", a1, max_new=3))
    h.run()
    h.add(req("b1", b1, max_new=3))
    h.run()
    a2 = _next_turn(h, "a1", a1)
    h.add(req("a2", a2, max_new=3))  # continues conversation a: a is now the most recent
    h.run()
    assert h.final("a2").cached_tokens > 0
    assert len({ck.continuation for ck in h.cache.checkpoints.values()}) == 2
    h.add(req("c1", _conversation("c"), max_new=3))  # a third conversation: b goes, a stays
    h.run()
    assert len({ck.continuation for ck in h.cache.checkpoints.values()}) == 2
    h.assert_balanced()
    b2, a3 = _next_turn(h, "b1", b1), _next_turn(h, "a2", a2)
    h.add(req("a3", a3, max_new=2))
    h.add(req("b2", b2, max_new=2))  # b comes back, a miss: c, past its predicted turn, gives way
    h.run()
    assert h.final("b2").cached_tokens == 0 and h.final("a3").cached_tokens > 0
    assert h.tokens("b2") == expected_continuation(b2, 2) and h.tokens("a3") == expected_continuation(a3, 2)
    h.assert_empty()


def test_an_abandoned_conversation_gives_way_to_a_new_one(byte_tokenizer):
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=4, limits=CacheLimits(max_private_continuations=1))
    old = _conversation("old")
    h.add(req("o1", old, max_new=2))
    h.run()
    h.add(req("o2", _next_turn(h, "o1", old), max_new=2))  # comes back at once: interval 1
    h.run()
    assert h.final("o2").cached_tokens > 0
    (abandoned,) = {ck.continuation for ck in h.cache.checkpoints.values()}
    prompt = _conversation("new")
    for turn in range(3):  # the new conversation's turns keep their checkpoints from its first one
        rid = f"n{turn}"
        h.add(req(rid, prompt, max_new=2))
        h.run()
        assert (h.final(rid).cached_tokens > 0) == (turn > 0)
        prompt = _next_turn(h, rid, prompt)
    assert abandoned not in {ck.continuation for ck in h.cache.checkpoints.values()}
    h.assert_empty()


def test_more_conversations_than_the_limit_taking_turns_keep_most_of_their_reuse(byte_tokenizer):
    # Three agent sessions taking turns at a limit of two: dropping the least recently used
    # conversation drops the one due next, so no turn would ever hit. The forecast keeps the two
    # due soonest and lets the third recompute: two turns in three reuse their history (the same
    # two: the third's checkpoint would be the one due last each time).
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=8, limits=CacheLimits(max_private_continuations=2))
    prompts = {name: _conversation(name) for name in "abc"}
    hits: list[list[bool]] = []
    for round_index in range(5):
        hits.append([])
        for name in "abc":
            rid = f"{name}{round_index}"
            h.add(req(rid, prompts[name], max_new=3))
            h.run()
            hits[-1].append(h.final(rid).cached_tokens > 0)
            assert h.tokens(rid) == expected_continuation(prompts[name], 3)
            prompts[name] = _next_turn(h, rid, prompts[name])
            h.assert_balanced()
            assert len({ck.continuation for ck in h.cache.checkpoints.values()}) <= 2
    assert all(sum(round_hits) == 2 for round_hits in hits[2:]), hits
    h.assert_empty()


def test_a_conversation_that_lost_its_checkpoints_keeps_its_identity(byte_tokenizer):
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=8, limits=CacheLimits(max_private_continuations=1))
    a1, b1 = _conversation("a"), _conversation("b")
    h.add(req("a1", a1, max_new=3))
    h.run()
    (conversation_a,) = {ck.continuation for ck in h.cache.checkpoints.values()}
    h.add(req("b1", b1, max_new=3))  # a conversation past the limit: a's checkpoints go
    h.run()
    assert conversation_a not in {ck.continuation for ck in h.cache.checkpoints.values()}
    a2 = _next_turn(h, "a1", a1)
    assert h.cache.forecast.recall(a2) == conversation_a  # what a dropped is remembered
    assert h.cache.forecast.recall(_conversation("z")) is None
    assert h.cache.forecast.recall(a1[:-1] + [a1[-1] + 1] + a2[len(a1):]) is None  # same tail, other prefix
    h.add(req("a2", a2, max_new=3))  # a comes back (a miss), still conversation a
    h.run()
    assert h.final("a2").cached_tokens == 0 and h.tokens("a2") == expected_continuation(a2, 3)
    assert h.cache.forecast.last_turn(conversation_a) == 3  # a2, the third admission, counted as a's turn
    h.assert_empty()


def test_shared_prefix_and_long_anchor_limits(byte_tokenizer):
    limits = CacheLimits(max_shared_prefixes=1, max_long_anchors=1)
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=6, limits=limits, kv_tokens=4096, max_context=2048,
                prefill_chunk=256)
    first, second = PROMPT, [ord(c) for c in "A different system prompt, then a question."]
    h.add(req("s1", first, max_new=2, capture_hints=[CaptureHint(20, "shared_stable_prefix")]))
    h.run()
    h.add(req("s2", second, max_new=2, capture_hints=[CaptureHint(25, "shared_stable_prefix")]))
    h.run()
    shared = [ck for ck in h.cache.checkpoints.values() if ck.path == "shared_stable_prefix"]
    assert [ck.frontier for ck in shared] == [25]  # the newer one replaced the older
    # Anchors sit in long prompts, apart from each other and from the prompt's ends (capture_frontiers).
    long_prompt = (PROMPT[::-1] * 20)[:1200]
    anchors = [CaptureHint(300, "private_long_anchor"), CaptureHint(800, "private_long_anchor")]
    h.add(req("l1", long_prompt, max_new=2, capture_hints=anchors))
    h.run()
    kept = [ck.frontier for ck in h.cache.checkpoints.values() if ck.path == "private_long_anchor"]
    assert kept == [800]  # one per continuation: the later capture replaced the earlier
    h.assert_balanced()
    # A zero limit keeps none of that kind.
    h0 = Harness(byte_tokenizer, limits=CacheLimits(max_shared_prefixes=0, max_private_continuations=0))
    h0.add(req("z", PROMPT, max_new=2, capture_hints=[CaptureHint(20, "shared_stable_prefix")]))
    h0.run()
    assert len(h0.cache) == 0 and h0.tokens("z") == expected_continuation(PROMPT, 2)
    h0.assert_empty()
    h.assert_empty()


def test_kv_pressure_spills_a_checkpoints_pages_to_the_host_and_a_hit_restores_them(byte_tokenizer):
    # A KV pool for about one conversation: the second pushes the first's checkpoints out of
    # the device KV; with a host KV tier they keep their pages there and the first resumes.
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=3, kv_tokens=96, page_size=8, host_kv_pages=24)
    first, second = _conversation("first") + PROMPT[:8], _conversation("other")
    h.add(req("a1", first, max_new=3))
    h.run()
    h.add(req("b1", second, max_new=3))
    h.run()
    assert any(isinstance(a, SpillPages) for s in h.steps for a in s.before)
    assert any(ck.kv_on_host for ck in h.cache.checkpoints.values())
    h.assert_balanced()
    a2 = _next_turn(h, "a1", first)
    h.add(req("a2", a2, max_new=4))
    h.run()
    assert h.final("a2").cached_tokens > len(first)
    assert any(isinstance(a, RestorePages) for s in h.steps for a in s.before)
    assert h.tokens("a2") == expected_continuation(a2, 4)  # the FakeRunner checked every restored position
    h.assert_balanced()
    h.assert_empty()


def test_without_a_host_kv_tier_kv_pressure_drops(byte_tokenizer):
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=3, kv_tokens=96, page_size=8)
    first = _conversation("first") + PROMPT[:8]
    h.add(req("a1", first, max_new=3))
    h.run()
    h.add(req("b1", _conversation("other"), max_new=3))
    h.run()
    a2 = _next_turn(h, "a1", first)
    h.add(req("a2", a2, max_new=4))
    h.run()
    assert h.final("a2").cached_tokens == 0 and h.tokens("a2") == expected_continuation(a2, 4)
    h.assert_empty()


def test_cheap_checkpoints_are_dropped_rather_than_spilled(byte_tokenizer):
    # Restoring a page costs more than recomputing the few tokens any checkpoint here saves.
    slow_link = (ContextCosts(1e-6, 1e3, "test"), 0, 1000)
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=3, kv_tokens=96, page_size=8, host_kv_pages=24,
                planner_rates=slow_link)
    h.add(req("a1", _conversation("first") + PROMPT[:8], max_new=3))
    h.run()
    h.add(req("b1", _conversation("other"), max_new=3))
    h.run()
    assert not any(isinstance(a, SpillPages) for s in h.steps for a in s.before)
    assert h.host_kv_pool.num_used == 0
    h.assert_empty()


def test_thinking_budget_forces_close_at_cap(byte_tokenizer):
    close = [ord(c) for c in "\nOK.\n"] + [256]  # 256 = <eos> plays </think>'s role here
    budget = ThinkingBudget(max_thinking_tokens=5, close_token_ids=close, think_end_token_id=255)
    h = Harness(byte_tokenizer)
    h.add(req("a", PROMPT, max_new=20, thinking_budget=budget))
    h.run()
    toks = h.tokens("a")
    assert toks[5 : 5 + len(close)] == close
    assert h.final("a").completion_tokens == 20
    assert sum(o.forced_token_count for o in h.outputs["a"]) == len(close)
    # the model continues from the inserted tokens
    assert toks[5 + len(close) :] == expected_continuation(PROMPT + toks[: 5 + len(close)], 20 - 5 - len(close))
    h.assert_empty()


def test_thinking_budget_capacity_rejected_at_preparation(byte_tokenizer):
    budget = ThinkingBudget(max_thinking_tokens=10, close_token_ids=[1, 2, 3], think_end_token_id=255)
    h = Harness(byte_tokenizer)
    h.add(req("a", PROMPT, max_new=13, thinking_budget=budget))  # 10 < 13 < 10 + 3 + 1
    assert h.final("a").error.code is ErrorCode.THINKING_BUDGET_CAPACITY
    h.add(req("ok-under", PROMPT, max_new=10, thinking_budget=budget))  # never reaches the cap
    h.add(req("ok-fits", PROMPT, max_new=14, thinking_budget=budget))
    h.run()
    assert h.final("ok-under").finish_reason is FinishReason.LENGTH
    assert h.final("ok-fits").finish_reason is FinishReason.LENGTH


def test_length_limit_wins_over_thinking_cap(byte_tokenizer):
    budget = ThinkingBudget(max_thinking_tokens=4, close_token_ids=[10, 11], think_end_token_id=255)
    h = Harness(byte_tokenizer)
    h.add(req("a", PROMPT, max_new=4, thinking_budget=budget))
    h.run()
    assert h.final("a").completion_tokens == 4
    assert 10 not in h.tokens("a")


def test_context_ceiling_and_output_clamp(byte_tokenizer):
    h = Harness(byte_tokenizer, max_context=70)
    h.add(req("long", PROMPT * 2, max_new=4))
    err = h.final("long").error
    assert err.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert err.prompt_tokens == len(PROMPT) * 2 and err.max_context == 70
    h.add(req("clamped", PROMPT, max_new=100))
    h.run()
    assert h.final("clamped").completion_tokens == 70 - len(PROMPT)
    assert h.final("clamped").finish_reason is FinishReason.LENGTH


def test_pending_deadline_expires_in_queue(byte_tokenizer):
    h = Harness(byte_tokenizer, max_concurrency=1)
    h.add(req("a", PROMPT, max_new=30))
    h.add(req("b", PROMPT[:10], max_new=3, deadline=0.05))
    h.run()
    assert h.final("b").error.code is ErrorCode.QUEUE_TIMEOUT
    assert h.final("a").finish_reason is FinishReason.LENGTH
    h.assert_empty()


def test_staggered_arrivals_many_requests_balanced(byte_tokenizer):
    h = Harness(byte_tokenizer, max_concurrency=3, kv_tokens=256, page_size=8, extra_slots=2, prefill_chunk=12)
    prompts = {f"r{i}": [ord(c) for c in f"request {i}: " + "lorem ipsum " * (i % 4 + 1)] for i in range(9)}
    pending = list(prompts.items())
    step_no = 0
    while pending or h.has_work:
        if pending and step_no % 3 == 0:
            rid, prompt = pending.pop(0)
            h.add(req(rid, prompt, max_new=5 + step_no % 7, stop_strings=["um l"] if step_no % 2 else []))
        if step_no == 10:
            aborted = h.scheduler.abort("r2")
            h._record([aborted] if aborted else [])
        h.step()
        h.assert_balanced()
        step_no += 1
        assert step_no < 2000
    for rid in prompts:
        assert len([o for o in h.outputs[rid] if o.finished]) == 1
    h.assert_empty()


def test_full_pool_reservation_with_mid_page_hit_adopts_instead_of_waiting(byte_tokenizer):
    # 16 pages of 8 tokens. The endpoint of t1 ends mid-page (frontier 65); t2 needs all 16 pages:
    # copying the hit would need one page more than exists, so t2 must adopt the checkpoint.
    h = Harness(byte_tokenizer, kv_tokens=128, page_size=8, max_context=128, max_concurrency=1, extra_slots=1)
    h.add(req("t1", PROMPT, max_new=5))
    h.run()
    follow = PROMPT + h.tokens("t1") + [ord(c) for c in " more"]
    h.add(req("t2", follow, max_new=1000))
    h.run(max_steps=500)
    out = h.final("t2")
    assert out.cached_tokens == len(PROMPT) + 4 and out.finish_reason is FinishReason.LENGTH
    assert h.tokens("t2") == expected_continuation(follow, 128 - len(follow))
    h.assert_empty()


def test_unusable_hit_falls_back_to_root(byte_tokenizer):
    # A non-exact (attention-only) hit that cannot fit beside its checkpoint is dropped, not waited on.
    h = Harness(byte_tokenizer, kv_tokens=128, page_size=8, max_context=128, max_concurrency=1, hybrid=False)
    h.add(req("t1", PROMPT, max_new=5))
    h.run()
    other = PROMPT[:40] + [ord(c) for c in " a different ending that is long enough"]
    h.add(req("t2", other, max_new=1000))
    h.run(max_steps=500)
    assert h.final("t2").finish_reason is FinishReason.LENGTH
    assert h.tokens("t2") == expected_continuation(other, 128 - len(other))
    h.assert_empty()
