"""Eager steps on CUDA: staged metadata (one pinned buffer, non-blocking copies) against the old path.

GPU tests (marked, skipped without CUDA), on the tiny random bf16 Llama and Qwen3.5 of
test_cuda_graphs.py with graphs off:
  * the plan of tests/engine/test_eager_staging.py (prefill rows of several lengths, decode
    rows, rounds launched ahead whose rows read the previous round's ids on the device) gives
    bitwise the same slot logits and sampled ids as the synchronous path it replaced;
  * an eager decode round, the round chained to it and a round with a row that does not
    sample are launched with torch.cuda.set_sync_debug_mode("error") (a blocking copy,
    .item(), .tolist() or nonzero() raises), and the profiler sees no copy from pageable
    memory (the driver stages those synchronously, which sync debug mode cannot see);
  * a pinned staging buffer is not rewritten while a copy out of it is still queued.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from ninfer.engine.runner import ModelRunner
from ninfer.engine.scheduler import SchedulerStep, StepKind
from ninfer.models.forward_batch import HostStaging
from tests.engine.test_eager_staging import SynchronousRunner, _chained, _chunk, new_runner, plan, run_plan
from tests.gpu.test_cuda_graphs import ARCHITECTURES, _model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("staging-models"))


@contextlib.contextmanager
def _no_host_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _rounds(runner: ModelRunner, checked: bool) -> None:
    """Decode rounds as the engine runs them eagerly: round 2 launched before round 1 is read."""
    decode = SchedulerStep(StepKind.DECODE, [
        _chunk("a", [40], 37), _chunk("b", [41], 50), _chunk("c", [42], 6), _chunk("d", [43], 3),
    ])
    ahead = SchedulerStep(StepKind.DECODE, [
        _chained("a", 38, 0), _chained("b", 51, 1), _chained("c", 7, 2), _chained("d", 4, 3),
    ])
    # A row that keeps its logits without sampling: the sampled ids are scattered by row.
    partial = SchedulerStep(StepKind.DECODE, [_chunk("a", [44], 39), _chunk("d", [45], 5, sample=False)])
    guard = _no_host_sync if checked else contextlib.nullcontext
    with guard():
        first = runner.launch(decode)
        second = runner.launch(ahead)
    first.result()
    with guard():
        third = runner.launch(partial)
    second.result()
    third.result()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_staged_eager_steps_equal_the_synchronous_path(arch, tmp_root):
    model = _model(arch, tmp_root, torch.bfloat16, "cuda")
    staged = run_plan(new_runner(ModelRunner, model))
    reference = run_plan(new_runner(SynchronousRunner, model))
    assert staged[0] == reference[0]
    assert len(staged[1]) == len(plan())
    for step, (got, want) in enumerate(zip(staged[1], reference[1])):
        assert torch.equal(got, want), f"step {step}: max |diff| {(got - want).abs().max().item()}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_eager_decode_neither_syncs_nor_copies_from_pageable_memory(arch, tmp_root):
    from torch.profiler import ProfilerActivity, profile

    model = _model(arch, tmp_root, torch.bfloat16, "cuda")
    runner = new_runner(ModelRunner, model)
    assert runner.graphs is None
    run_plan(runner)  # fills the caches
    _rounds(runner, checked=False)  # compiles the kernels of these shapes, sizes the staging buffers
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _rounds(runner, checked=True)
        torch.cuda.synchronize()
    copies = [event.key for event in prof.key_averages() if event.key.startswith("Memcpy")]
    assert not [name for name in copies if "Pageable" in name], copies
    assert any(name.startswith("Memcpy HtoD (Pinned") for name in copies), copies  # the check saw the copies


@pytest.mark.gpu
@needs_cuda
def test_pinned_staging_is_not_rewritten_while_its_copy_is_queued():
    staging = HostStaging("cuda", num_turns=2)
    torch.cuda._sleep(200_000_000)  # ~0.1 s: the copies below queue behind it
    received = []
    for step in range(4):
        staging.next_step()  # step 2 reuses step 0's buffers: it must wait until their copy has run
        staged = staging.add(np.full(1024, step, dtype=np.int64))
        staging.flush()
        received.append(staged.clone())  # queued before any later copy into the same device buffer
    torch.cuda.synchronize()
    assert [t.unique().tolist() for t in received] == [[0], [1], [2], [3]]
