"""build_engine_core's CPU choices: torch threads and float16 Linear weights under --dtype auto; a
DFlash2 companion loaded beside the artifact."""

from __future__ import annotations

import pytest
import torch

from ninfer.config import EngineConfig
from ninfer.contract.request import EngineRequest
from ninfer.contract.sampling import SamplingParams
from ninfer.engine import builder
from ninfer.engine.builder import EngineSpec, build_engine_core, cpu_half_weights, cpu_threads
from ninfer.engine.speculative.dflash_drafter import DflashDrafter
from ninfer.models.quant.half_weights import HalfWeightLinear
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from ninfer.testing.tiny_dflash import make_tiny_dflash


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 1), (3, 1), (8, 4)])
def test_cpu_threads_take_one_per_two_cpus(monkeypatch, cpus, threads) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(builder.os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert cpu_threads() == threads


def test_cpu_threads_follow_omp_num_threads(monkeypatch, restore_threads) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)
    assert cpu_threads() == 3


def test_half_weights_only_for_auto_float32_on_a_vectorizing_cpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert cpu_half_weights("auto", torch.float32, "cpu")
    assert not cpu_half_weights("float32", torch.float32, "cpu")  # an explicit dtype is kept as asked
    assert not cpu_half_weights("auto", torch.bfloat16, "cuda:0")
    assert not cpu_half_weights("bfloat16", torch.bfloat16, "cpu")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert not cpu_half_weights("auto", torch.float32, "cpu")


def test_cpu_engine_as_the_server_builds_it(monkeypatch, tmp_path, restore_threads) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    path = make_tiny_qwen3_5(tmp_path)
    config = EngineConfig(max_context=128, log_stats_interval_ms=0)
    core = build_engine_core(EngineSpec(str(path), config))
    assert torch.get_num_threads() == cpu_threads()
    model = core.runner.model
    assert next(model.parameters()).dtype == torch.float32
    assert isinstance(model.lm_head, HalfWeightLinear)
    assert any(isinstance(m, HalfWeightLinear) for m in model.model.layers.modules())
    core.add_request(EngineRequest("r", list(range(10, 30)), SamplingParams(temperature=0.0), max_new_tokens=4))
    outputs = []
    while core.has_work:
        outputs.extend(core.step())
    assert sum(len(o.new_token_ids) for o in outputs) == 4 and outputs[-1].finished


def test_a_dflash2_companion_beside_the_artifact_drafts_as_the_server_builds_it(tmp_path, restore_threads) -> None:
    path = make_tiny_qwen3_5(tmp_path)
    make_tiny_dflash(path, "dflash2", dtype="bfloat16")
    config = EngineConfig(max_context=128, log_stats_interval_ms=0, spec="dflash2", draft_tokens=3, lm_head_draft=True)
    core = build_engine_core(EngineSpec(str(path), config))
    drafter = core.runner.speculator.drafter
    assert isinstance(drafter, DflashDrafter) and drafter.model.config.kind == "dflash2"
    assert core.runner.paged_caches == [core.runner.kv_cache, drafter.kv_cache]
    assert core.memory_ledger["kv_pool"] == sum(c.k.numel() * c.k.element_size() * 2 for c in core.runner.paged_caches)
    core.add_request(EngineRequest("r", list(range(10, 30)), SamplingParams(temperature=0.0), max_new_tokens=6))
    outputs = []
    while core.has_work:
        outputs.extend(core.step())
    assert sum(len(o.new_token_ids) for o in outputs) == 6 and outputs[-1].speculative.rounds > 0


def test_draft_fp8_quantizes_the_dflash_drafter_at_load(tmp_path, restore_threads, caplog) -> None:
    from ninfer.models.quant.fp8 import Fp8Linear

    path = make_tiny_qwen3_5(tmp_path)
    make_tiny_dflash(path, "dflash2", dtype="bfloat16")
    config = EngineConfig(max_context=128, log_stats_interval_ms=0, spec="dflash2", draft_tokens=3, lm_head_draft=True,
                          draft_fp8=True)
    with caplog.at_level("INFO", logger="ninfer.engine"):
        core = build_engine_core(EngineSpec(str(path), config))
    drafter = core.runner.speculator.drafter
    layers = [m for m in drafter.model.modules() if isinstance(m, Fp8Linear)]
    assert layers and f"--draft-fp8: {len(layers)} drafter layers in FP8" in caplog.text
    assert not any(isinstance(m, Fp8Linear) for m in core.runner.model.model.modules())  # the target stays as loaded
    core.add_request(EngineRequest("r", list(range(10, 30)), SamplingParams(temperature=0.0), max_new_tokens=6))
    outputs = []
    while core.has_work:
        outputs.extend(core.step())
    assert sum(len(o.new_token_ids) for o in outputs) == 6 and outputs[-1].speculative.rounds > 0
