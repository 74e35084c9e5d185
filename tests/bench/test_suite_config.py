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


def test_verify_cases_time_speculative_rounds_against_plain_rounds(monkeypatch):
    """The verify case on the CPU (tiny shape, eager): a runner per draft count, a round of
    verification rows after the commit of a whole round, recorded against the plain round."""
    from ninfer.bench.roofline import DeviceCeilings

    for name in ("reset_peak_memory_stats", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args, **kwargs: 0)
    options = BenchOptions(shapes=["tiny"], weights=["bf16"], batches=[1, 2], contexts=[64], prefill_lengths=[],
                           decode_rounds=2, cuda_graphs=False, decode_overlap=False, verify_drafts=[2])
    bench = Suite(options, device="cpu")
    bench.ceilings = DeviceCeilings(copy_bytes_per_s=1e12, bf16_flops_per_s=1e14, name="cpu")
    bench._run_ours("tiny", "bf16")
    verify = [r for r in bench.results if r.kind == "verify"]
    assert [(r.batch, r.draft_tokens) for r in verify] == [(1, 2), (2, 2)]
    for r in verify:
        assert r.round_ratio is not None and r.round_ratio > 0
        # With every draft accepted a round yields batch * (K+1) tokens: the ceiling it reports.
        round_s = float(r.note.split("round ")[1].split(" ms")[0]) / 1e3
        ahead_s = float(r.note.split("launched ahead of each read ")[1].split(" ms")[0]) / 1e3
        assert 0 < ahead_s and " = " in r.note.split("launched ahead of each read ")[1]
        assert r.tokens_per_s == pytest.approx(r.batch * 3 / round_s, rel=1e-2)
        assert "eager" in r.note


def test_decode_cases_run_each_kv_format_and_nvfp4_weights(monkeypatch):
    """Every --kv-dtypes format gets its own runner and its own decode cases, labelled with it,
    with the format's bytes in the roofline; NVFP4 weights stream 0.5625 bytes an element."""
    from ninfer.bench.report import markdown_table
    from ninfer.bench.roofline import DeviceCeilings

    for name in ("reset_peak_memory_stats", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args, **kwargs: 0)
    options = BenchOptions(shapes=["tiny"], weights=["nvfp4"], batches=[1], contexts=[64], prefill_lengths=[],
                           decode_rounds=2, cuda_graphs=False, decode_overlap=False, kv_dtypes=["bf16", "int8"])
    bench = Suite(options, device="cpu")
    bench.ceilings = DeviceCeilings(copy_bytes_per_s=1e12, bf16_flops_per_s=1e14, name="cpu")
    bench._run_ours("tiny", "nvfp4")
    decode = [r for r in bench.results if r.kind == "decode"]
    assert [r.kv_dtype for r in decode] == ["bf16", "int8"]
    assert decode[1].roofline_tokens_per_s > decode[0].roofline_tokens_per_s  # fewer KV bytes per round
    table = markdown_table({"device": "cpu", "ceilings": dataclasses.asdict(bench.ceilings), "torch": "",
                            "results": [dataclasses.asdict(r) for r in decode]})
    assert "| tiny | nvfp4, KV int8 | decode |" in table and "| tiny | nvfp4 | decode |" in table


def test_cases_whose_kv_does_not_fit_are_skipped_and_the_rest_run(monkeypatch):
    """On a device with too little memory beside the model for every case's KV pool, the pool
    takes what fits; the cases that need more are listed as skipped, the others still run."""
    from ninfer.bench.report import markdown_table
    from ninfer.bench.roofline import DeviceCeilings

    for name in ("reset_peak_memory_stats", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args, **kwargs: 0)
    page_size = EngineConfig().page_size
    options = BenchOptions(shapes=["tiny"], weights=["bf16"], batches=[1, 2], contexts=[64, 512], prefill_lengths=[32],
                           decode_rounds=2, cuda_graphs=False, decode_overlap=False)
    bench = Suite(options, device="cpu")
    bench.ceilings = DeviceCeilings(copy_bytes_per_s=1e12, bf16_flops_per_s=1e14, name="cpu")
    fitting = 2 * (-(-65 // page_size)) + (-(-513 // page_size))  # batch 2 at 64 fits, and batch 1 at 512
    wanted = []

    def pages_that_fit(model, pages, max_batch, kv_dtype, device, label):
        wanted.append(pages)
        return fitting

    monkeypatch.setattr(suite, "pages_that_fit", pages_that_fit)
    bench._run_ours("tiny", "bf16")
    assert wanted == [2 * (-(-512 // page_size) + 1)]
    decode = [(r.batch, r.tokens) for r in bench.results if r.kind == "decode"]
    assert decode == [(1, 64), (2, 64), (1, 512)]
    assert [r.kind for r in bench.results].count("prefill") == 1
    assert len(bench.skipped) == 1 and "decode, batch 2, context 512: skipped" in bench.skipped[0]
    table = markdown_table({"device": "cpu", "ceilings": dataclasses.asdict(bench.ceilings), "torch": "",
                            "results": [dataclasses.asdict(r) for r in bench.results], "skipped": bench.skipped})
    assert "Not run" in table and "batch 2, context 512" in table


def test_the_pool_takes_the_pages_that_fit_in_free_memory(monkeypatch):
    from ninfer.bench.shapes import shape_config
    from ninfer.engine.core import kv_page_bytes, state_image_bytes
    from ninfer.models.loader import build_model

    _, config = shape_config("tiny")
    model = build_model(config, torch.bfloat16, torch.device("cpu"))
    assert suite.pages_that_fit(model, 1000, 4, "bf16", torch.device("cpu"), "tiny") == 1000  # no device memory to ask about
    cuda = torch.device("cuda", 0)
    page = kv_page_bytes(model, EngineConfig().page_size)
    reserve = state_image_bytes(model) * 5 + suite._RUNNER_RESERVE_BYTES
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (reserve + 300 * page, 1 << 40))
    assert suite.pages_that_fit(model, 1000, 4, "bf16", cuda, "tiny") == 300
    assert suite.pages_that_fit(model, 200, 4, "bf16", cuda, "tiny") == 200


def test_verify_cases_with_an_fp8_drafter(monkeypatch):
    from ninfer.bench.roofline import DeviceCeilings

    for name in ("reset_peak_memory_stats", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args, **kwargs: 0)
    options = BenchOptions(shapes=["tiny"], weights=["bf16"], batches=[1], contexts=[64], prefill_lengths=[],
                           decode_rounds=2, cuda_graphs=False, decode_overlap=False, verify_drafts=[2], draft_fp8=True)
    bench = Suite(options, device="cpu")
    bench.ceilings = DeviceCeilings(copy_bytes_per_s=1e12, bf16_flops_per_s=1e14, name="cpu")
    built = []
    original = suite.ModelRunner

    def runner(model, *args, **kwargs):
        built.append(kwargs["draft_fp8"])
        return original(model, *args, **kwargs)

    monkeypatch.setattr(suite, "ModelRunner", runner)
    bench._run_ours("tiny", "bf16")
    assert built == [False, True]  # the decode cases' runner, then the verify cases'
    verify = [r for r in bench.results if r.kind == "verify"]
    assert len(verify) == 1 and "drafter FP8" in verify[0].note
