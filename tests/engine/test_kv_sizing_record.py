"""--kv-capacity auto on a restart: the probe's figures come from the record an earlier start kept
under the same key, the pool is sized from them and the memory free now, and a record that the
final engine's warm-up outgrows is dropped. The device's memory calls are stubbed: the CPU has
no CUDA, and these tests are about what is measured when, not about the measurements."""

from __future__ import annotations

import pytest
import torch

from ninfer.config import EngineConfig
from ninfer.engine import builder
from ninfer.engine.kv_sizing_record import (
    WORKSPACE_SLACK_BYTES,
    AutoSizing,
    KvSizingRecords,
    ProbeMeasure,
    probe_key,
    source_digest,
)
from ninfer.artifact import open_artifact
from ninfer.models.loader import build_model
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5

GIB = 1 << 30
MEASURE = ProbeMeasure(worst_step_bytes=3 * GIB, graph_bytes=GIB // 2, worst_step_tokens=2048)


def test_a_record_reads_back_under_its_key_only(tmp_path) -> None:
    records = KvSizingRecords(tmp_path / "kv-sizing")
    key, other = probe_key("a", "b"), probe_key("a", "c")
    assert key != other and len(key) == 64
    assert records.load(key) is None
    records.store(key, MEASURE)
    assert records.load(key) == MEASURE
    assert records.load(other) is None
    records.drop(key)
    records.drop(key)  # twice: nothing to remove the second time
    assert records.load(key) is None


def test_the_key_covers_the_code(monkeypatch) -> None:
    key = probe_key("config")
    monkeypatch.setattr("ninfer.engine.kv_sizing_record.source_digest", lambda: "another build")
    assert probe_key("config") != key
    assert len(source_digest()) == 64


def test_an_unreadable_record_means_a_probe(tmp_path, caplog) -> None:
    records = KvSizingRecords(tmp_path)
    key = probe_key("x")
    records.store(key, MEASURE)
    path = next(tmp_path.glob("*.json"))
    path.write_text("{not json")
    assert records.load(key) is None
    assert "unreadable" in caplog.text
    path.write_text('{"key": "%s", "measure": {"worst_step_bytes": 1}}' % key)  # a field missing
    assert records.load(key) is None


def test_a_folder_that_cannot_be_written_costs_only_the_record(tmp_path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    KvSizingRecords(blocker / "kv-sizing").store(probe_key("x"), MEASURE)  # a file where the folder goes
    assert "not kept" in caplog.text


def test_a_workspace_past_the_probes_worst_step_drops_the_record(tmp_path, caplog) -> None:
    records = KvSizingRecords(tmp_path)
    key = probe_key("x")
    records.store(key, MEASURE)
    sizing = AutoSizing(records, key, MEASURE)
    sizing.confirm(MEASURE.worst_step_bytes + WORKSPACE_SLACK_BYTES)  # within the slack: kept
    assert records.load(key) == MEASURE
    sizing.confirm(MEASURE.worst_step_bytes + WORKSPACE_SLACK_BYTES + 1)
    assert records.load(key) is None and "measures again" in caplog.text


@pytest.fixture
def stub_device(monkeypatch, tmp_path):
    """A 'cuda' engine configuration on the CPU: 40 GiB free, the probe counted instead of run."""
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * GIB, 80 * GIB))
    monkeypatch.setattr(builder, "_probe_inputs", lambda model, draft_model, device: ("device", "libraries"))
    probes = []

    def probe(model, tokenizer, probe_config, draft_model, page_bytes, slot_bytes, followers=None, grammars=None):
        probes.append(probe_config)
        probe.grammars = grammars
        return MEASURE

    monkeypatch.setattr(builder, "_probe", probe)
    return probes


def test_a_restart_sizes_the_pool_from_the_kept_record(stub_device, tmp_path) -> None:
    config = open_artifact(make_tiny_qwen3_5(tmp_path / "model")).config
    model = build_model(config, dtype=torch.float32, device="cpu")
    engine = EngineConfig(device="cuda:0", max_context=1 << 20, max_concurrency=2, log_stats_interval_ms=0)
    first_tokens, first = builder._auto_kv_tokens(model, None, engine)
    assert len(stub_device) == 1 and first.measure == MEASURE
    again_tokens, again = builder._auto_kv_tokens(model, None, engine)
    assert len(stub_device) == 1  # no second probe
    assert again_tokens == first_tokens > 0 and again.key == first.key
    # Another step shape is another probe; its engine compiles grammars in the served engine's set.
    grammars = object()
    builder._auto_kv_tokens(model, None, EngineConfig(**{**vars(engine), "prefill_chunk": engine.prefill_chunk // 2}),
                            grammars=grammars)
    assert len(stub_device) == 2 and builder._probe.grammars is grammars
    # A record the final warm-up outgrew is measured again.
    again.confirm(MEASURE.worst_step_bytes + 2 * WORKSPACE_SLACK_BYTES)
    builder._auto_kv_tokens(model, None, engine)
    assert len(stub_device) == 3


def test_the_key_covers_the_device_libraries_and_kernel_settings(monkeypatch, tmp_path) -> None:
    import types

    device = types.SimpleNamespace(name="NVIDIA H200", total_memory=141 * GIB, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: device)
    config = open_artifact(make_tiny_qwen3_5(tmp_path / "model")).config
    model = build_model(config, dtype=torch.float32, device="cpu")
    monkeypatch.delenv("NINFER_PDL", raising=False)
    inputs = builder._probe_inputs(model, None, torch.device("cuda:0"))
    assert builder._probe_inputs(model, None, torch.device("cuda:0")) == inputs
    monkeypatch.setenv("NINFER_PDL", "0")  # other kernels launch: another worst step
    assert builder._probe_inputs(model, None, torch.device("cuda:0")) != inputs
    monkeypatch.delenv("NINFER_PDL")
    device.total_memory = 80 * GIB
    assert builder._probe_inputs(model, None, torch.device("cuda:0")) != inputs
