"""Mixed steps on the GPU: decode rows and prompt chunks of several requests in one forward give
what each computed alone gives (the varlen GDN, conv and attention kernels with 1-token and
long rows together, continuation chunks over cached context included), and a chunk that
snapshots a checkpoint inside its step gives what two steps and a slot copy give."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from ninfer.contract.sampling import SamplingParams
from ninfer.engine.runner import ModelRunner
from ninfer.engine.scheduler import CopySlot, ResetSlot, ScheduledChunk, SchedulerStep, StepKind
from ninfer.kernels.moe import kernel_choice
from tests.gpu.test_cuda_graphs import ARCHITECTURES, _model, needs_cuda

pytestmark = [pytest.mark.gpu, needs_cuda]
GREEDY = SamplingParams(temperature=0.0, seed=0)
PAGE_SIZE = 16
PAGES_PER_REQUEST = 16  # 256 tokens each


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("mixed-step-models"))


def chunk(index: int, tokens: list[int], num_computed: int, sample: bool = True) -> ScheduledChunk:
    pages = list(range(index * PAGES_PER_REQUEST, (index + 1) * PAGES_PER_REQUEST))
    return ScheduledChunk(f"r{index}", tokens, num_computed, pages, index, compute_logits=True, sample=sample,
                          sampling=GREEDY, num_generated=0, output_token_ids=[])


@contextlib.contextmanager
def prefill_expert_kernels(monkeypatch, model):
    """The MoE picks its expert kernel by a step's (token, expert) pairs: a step of a few tokens
    takes the decode-mode kernel, a mixed step of many the prefill route (grouped GEMM in 16 bits),
    and the two sum in other orders (a router near a tie then picks another expert: far apart).
    Inside this block every MoE step takes the prefill route, so a step compares with the mixed
    step it stands for on the same kernels; elsewhere nothing changes."""
    if not model.config.is_moe:
        yield
        return
    def prefill_route(num_pairs: int, num_experts: int) -> tuple[bool, int]:
        return kernel_choice.tile_rows(max(num_pairs, kernel_choice.DECODE_MAX_PAIRS + 1), num_experts)

    with monkeypatch.context() as patch:
        patch.setattr("ninfer.kernels.moe.triton.tile_rows", prefill_route)
        yield


def tokens(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_a_mixed_step_equals_its_rows_computed_one_by_one(arch, tmp_root, monkeypatch):
    model = _model(arch, tmp_root, torch.bfloat16, "cuda")
    runners = [ModelRunner(model, 6 * PAGES_PER_REQUEST, PAGE_SIZE, num_state_slots=6) for _ in range(2)]
    histories = {i: tokens(i, 30 + 17 * i) for i in range(4)}  # requests 0..3 hold a cache; 4, 5 start
    for runner in runners:
        fresh = [ResetSlot(slot) for slot in range(6)]  # as admission does: slots start from zero state
        for i, prompt in histories.items():
            runner.execute(SchedulerStep(StepKind.PREFILL, [chunk(i, prompt, 0)], before=fresh if i == 0 else []))
    mixed_rows = [
        chunk(0, [7], len(histories[0])),  # decode rows at different contexts
        chunk(1, [8], len(histories[1])),
        chunk(4, tokens(40, 100), 0),  # a prompt's first chunk
        chunk(2, [9], len(histories[2])),
        chunk(3, tokens(41, 37), len(histories[3])),  # a continuation chunk over cached context
        chunk(5, tokens(42, 1), 0),  # a one-token prompt
    ]
    together, alone = runners
    mixed_ids = together.execute(SchedulerStep(StepKind.MIXED, mixed_rows))
    alone_ids = {}
    for row in mixed_rows:
        if len(row.token_ids) > 1:  # on the mixed step's expert kernels (a MoE row alone has fewer pairs)
            with prefill_expert_kernels(monkeypatch, model):
                alone_ids.update(alone.execute(SchedulerStep(StepKind.PREFILL, [row])))
        else:
            alone_ids.update(alone.execute(SchedulerStep(StepKind.PREFILL, [row])))
    for row in mixed_rows:
        pages = torch.tensor(row.page_ids, device="cuda")
        pairs = [("logits", together.slot_logits[row.state_slot], alone.slot_logits[row.state_slot]),
                 ("keys", together.kv_cache.k[:, pages], alone.kv_cache.k[:, pages])]
        if together.state_cache is not None:
            pairs.append(("state", together.state_cache.recurrent[:, row.state_slot],
                          alone.state_cache.recurrent[:, row.state_slot]))
        for what, got, want in pairs:
            diff = (got.float() - want.float()).abs().max().item()
            if len(row.token_ids) > 1:  # the same kernels either way: the batch's other rows change nothing
                assert diff == 0.0, f"{row.request_id} {what}: max |diff| {diff}"
            else:  # alone, a 1-token row takes the decode kernels (fused conv GEMV, recurrent step): bf16 apart
                scale = want.float().abs().max().item()
                assert diff <= 0.05 * scale, f"{row.request_id} {what}: max |diff| {diff} (scale {scale:.3g})"
                if what == "logits":  # the bound tells rows apart: another request's logits lie outside it
                    other = alone.slot_logits[(row.state_slot + 1) % len(mixed_rows)]
                    assert (other.float() - want.float()).abs().max().item() > 0.05 * scale
    assert mixed_ids.keys() == alone_ids.keys()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_a_checkpoint_inside_a_step_equals_one_copied_after_a_step_that_ends_there(arch, tmp_root, monkeypatch):
    """A prompt chunk that snapshots its frontier inside the step (beside a decode row) leaves the
    same checkpoint and the same request state as a step ending at the frontier, a slot copy, then
    a step for the rest."""
    model = _model(arch, tmp_root, torch.bfloat16, "cuda")
    runners = [ModelRunner(model, 6 * PAGES_PER_REQUEST, PAGE_SIZE, num_state_slots=6) for _ in range(2)]
    decoding, prompt, frontier, snapshot_slot = tokens(1, 45), tokens(50, 140), 133, 5
    for runner in runners:
        fresh = [ResetSlot(slot) for slot in range(6)]
        runner.execute(SchedulerStep(StepKind.PREFILL, [chunk(1, decoding, 0)], before=fresh))
    inside, after = runners
    snapshotting = dataclasses.replace(chunk(0, prompt, 0), snapshot_tokens=frontier, snapshot_slot=snapshot_slot)
    inside.execute(SchedulerStep(StepKind.MIXED, [chunk(1, [7], len(decoding)), snapshotting]))
    first_part = chunk(0, prompt[:frontier], 0, sample=False)
    with prefill_expert_kernels(monkeypatch, model):  # the last 7 tokens alone: the inside step's kernels
        after.execute(SchedulerStep(StepKind.MIXED, [chunk(1, [7], len(decoding)), first_part]))
        after.execute(SchedulerStep(StepKind.PREFILL, [chunk(0, prompt[frontier:], frontier)],
                                    before=[CopySlot(0, snapshot_slot)]))
    pages = torch.tensor(chunk(0, [], 0).page_ids, device="cuda")
    pairs = [("checkpoint logits", inside.slot_logits[snapshot_slot], after.slot_logits[snapshot_slot]),
             ("logits", inside.slot_logits[0], after.slot_logits[0]),
             ("keys", inside.kv_cache.k[:, pages], after.kv_cache.k[:, pages])]
    if inside.state_cache is not None:
        for slot, what in ((snapshot_slot, "checkpoint"), (0, "request")):
            for name in ("recurrent", "conv"):
                got, want = getattr(inside.state_cache, name), getattr(after.state_cache, name)
                pairs.append((f"{what} {name} state", got[:, slot], want[:, slot]))
    for what, got, want in pairs:
        diff = (got.float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        assert diff <= 0.02 * scale, f"{what}: max |diff| {diff} (scale {scale:.3g})"
    # the bound tells states apart: the request's logits lie outside it around the checkpoint's
    far = (after.slot_logits[0].float() - after.slot_logits[snapshot_slot].float()).abs().max().item()
    assert far > 0.02 * after.slot_logits[snapshot_slot].float().abs().max().item()
