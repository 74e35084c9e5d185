"""The load benchmark on a tiny artifact on the CPU: a burst and two closed-loop concurrency levels
against one ninfer-serve, every request streamed with its tokens, TTFT and inter-token gaps
recorded and summarized. Assertions are on what is recorded, never on speed."""

from __future__ import annotations

import json
import sys

import pytest

from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.net import free_port, load_script

OUTPUT_TOKENS = 8






def test_percentile_interpolates_between_closest_ranks():
    percentile = load_script("benchmarks/load.py", "load_benchmark").percentile
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([1.0, 2.0, 3.0], 0) == 1.0 and percentile([1.0, 2.0, 3.0], 100) == 3.0


def test_prompt_phase_steps_separate_the_steps_that_end_a_prompt():
    """Three streams: a decodes from t = 1.0 at 10 ms steps, b's first token arrives with a's step
    at 1.05 (a 30 ms step), c's with the step at 1.10 (also 30 ms); gaps after the last first
    token are not counted."""
    load = load_script("benchmarks/load.py", "load_benchmark")

    def record(index: int, first: float, gaps: list[float]):
        return load.RequestRecord("burst", "burst", index, index, 8, status=200, ttft_s=first, itl_s=gaps)

    a = record(0, 1.0, [0.01, 0.01, 0.03, 0.01, 0.01, 0.03, 0.01, 0.01])  # steps end 1.01 1.02 1.05 1.06 1.07 1.10 ...
    b = record(1, 1.05, [0.01, 0.01, 0.03, 0.01])  # first token at 1.05; its gaps end with a's steps
    c = record(2, 1.10, [0.01])
    steps = load.prompt_phase_steps([a, b, c])
    assert steps["prompt_end_steps"] == 2 and steps["prompt_end_step_p50_s"] == pytest.approx(0.03)
    assert steps["other_prompt_phase_steps"] == 4 and steps["other_step_p50_s"] == pytest.approx(0.01)
    assert load.prompt_phase_steps([a]) is None  # one stream: nothing to compare
    line = load.prompt_phase_lines([{"scenario": "burst", "prompt_phase_steps": steps}])[0]
    assert "2 steps that ended a prompt closed gaps of 30.0 ms" in line and "other 4 10.0 ms" in line


@pytest.mark.slow  # one server start and ~10 short requests: ~20 s on 2 cores
def test_burst_and_concurrency_record_every_request(tmp_path_factory):
    artifact = make_tiny_qwen3_5(tmp_path_factory.getbasetemp() / "artifacts")
    out = tmp_path_factory.mktemp("load")
    argv = ["--serve", str(artifact), "--serve-command", f"{sys.executable} -m ninfer.cli serve",
            "--server-args", "--max-concurrency 3 --log-stats-interval-ms 0",
            "--scenario", "burst", "--scenario", "concurrency", "--burst-requests", "3", "--prompt-tokens", "200",
            "--output-tokens", str(OUTPUT_TOKENS), "--concurrency-levels", "1,2", "--requests-per-client", "2",
            "--port", str(free_port()), "--out", str(out)]
    assert load_script("benchmarks/load.py", "load_benchmark").main(argv) == 0
    lines = [json.loads(line) for line in (out / "load.jsonl").read_text().splitlines()]
    requests = [r for r in lines if r["record"] == "request"]
    summaries = {(s["scenario"], s["group"]): s for s in lines if s["record"] == "summary"}
    assert sum(1 for r in requests if r["scenario"] == "burst") == 3
    assert sum(1 for r in requests if r["group"] == "c=1") == 1 * 2
    assert sum(1 for r in requests if r["group"] == "c=2") == 2 * 2
    for r in requests:
        assert r["status"] == 200 and r["error"] is None, r
        assert 150 <= r["prompt_tokens"] <= 250 and r["cached_tokens"] == 0  # distinct prompts: nothing reused
        # Random weights rarely stop early; if one did, the record must say so, not hide it.
        assert (r["finish_reason"], r["completion_tokens"]) == ("length", OUTPUT_TOKENS) or (
            r["finish_reason"] == "stop" and r["completion_tokens"] < OUTPUT_TOKENS), r
        assert sum(r["chunk_tokens"]) <= r["completion_tokens"]
        assert r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
        assert len(r["itl_s"]) == len(r["chunk_tokens"]) - 1 >= 1 and all(gap >= 0 for gap in r["itl_s"])
    assert set(summaries) == {("burst", "burst"), ("concurrency", "c=1"), ("concurrency", "c=2")}
    for (scenario, group), s in summaries.items():
        group_requests = [r for r in requests if r["group"] == group]
        assert s["succeeded"] == s["requests"] == len(group_requests) and s["errors_by_status"] == {}
        assert s["completion_tokens_total"] == sum(r["completion_tokens"] for r in group_requests)
        assert s["requests_not_at_asked_length"] == sum(r["completion_tokens"] != OUTPUT_TOKENS for r in group_requests)
        for name in ("ttft", "itl", "e2e"):
            assert s[f"{name}_p50_s"] > 0 and s[f"{name}_p99_s"] >= s[f"{name}_p50_s"]
        assert s["ttft_samples"] == s["e2e_samples"] == len(group_requests)
        assert s["itl_samples"] == sum(len(r["itl_s"]) for r in group_requests)
        assert s["output_tok_per_s"] > 0 and s["prompt_tok_per_s"] > 0 and s["makespan_s"] > 0
    assert "| burst |" in (out / "load.md").read_text()
