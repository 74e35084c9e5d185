"""`ninfer bench` measures the server's configuration: its page size and prefill chunk come from EngineConfig."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ninfer.bench import suite
from ninfer.bench.suite import BenchOptions, Suite
from ninfer.config import EngineConfig


def test_bench_options_follow_the_server_defaults():
    assert BenchOptions().prefill_chunk == EngineConfig().prefill_chunk
    # The server has no page-size option, so the bench has none either.
    assert "page_size" not in {f.name for f in dataclasses.fields(BenchOptions)}


def test_bench_runner_uses_the_server_page_size(monkeypatch):
    class Built(Exception):
        pass

    built = {}

    def runner(model, num_pages, page_size, **kwargs):
        built.update(num_pages=num_pages, page_size=page_size)
        raise Built

    monkeypatch.setattr(suite, "ModelRunner", runner)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *args, **kwargs: None)
    options = BenchOptions(shapes=["tiny"], weights=["bf16"], batches=[2], contexts=[100], prefill_lengths=[40])
    with pytest.raises(Built):
        Suite(options, device="cpu")._run_ours("tiny", "bf16")
    page_size = EngineConfig().page_size
    assert built["page_size"] == page_size
    assert built["num_pages"] == 2 * (-(-100 // page_size) + 1)  # every decode row's context, plus one page
