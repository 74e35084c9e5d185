"""The agent-loop benchmark on a tiny artifact on the CPU: ninfer-serve at its default capacities
(one lane) keeps two interleaved sessions' conversations cached in all three APIs, and the same
run under --no-prefix-reuse reuses nothing. Assertions are on reuse, never on speed."""

from __future__ import annotations

import json
import shutil

import pytest

from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.net import free_port, load_script

pytestmark = pytest.mark.slow  # two server starts and ~50 requests: ~30 s on 2 cores






@pytest.mark.skipif(shutil.which("ninfer-serve") is None, reason="ninfer-serve is not installed")
def test_two_interleaved_sessions_reuse_their_conversations(tmp_path_factory):
    artifact = make_tiny_qwen3_5(tmp_path_factory.getbasetemp() / "artifacts")
    out = tmp_path_factory.mktemp("agent-loop")
    benchmark = load_script("benchmarks/agent_loop.py", "agent_loop")
    argv = ["--serve", str(artifact), "--server-args", "--log-stats-interval-ms 0", "--prefix-tokens", "400",
            "--result-tokens", "30,90", "--turns", "4", "--max-tokens", "6", "--out", str(out),
            "--compare-no-reuse", "--no-reuse-turns", "2", "--port", str(free_port())]
    assert benchmark.main(argv) == 0
    report = json.loads((out / "agent_loop.json").read_text())
    for api in ("chat", "responses", "messages"):
        turns = report["reuse"][api]["turns"]
        assert len(turns) == 2 * 4
        for turn in turns:
            if turn["turn"] == 1:
                assert turn["cached_tokens"] == 0 and turn["path"] == "root"
            else:
                # Every later turn resumes from what its own session left, despite the other session.
                assert turn["reuse_of_previous"] >= 0.95, (api, turn)
                assert turn["path"] not in (None, "root"), (api, turn)
                assert turn["cached_tokens"] < turn["prompt_tokens"]
        without = report["no_reuse"][api]["turns"]
        assert len(without) == 2 * 2 and all(t["cached_tokens"] == 0 for t in without)
    assert (out / "agent_loop.md").read_text().count("## ") == 6
