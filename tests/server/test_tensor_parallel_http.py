"""ninfer-serve --tensor-parallel 2 as a process, through the official openai SDK: it answers as one
rank does (speculating with the MTP head too), a killed follower rank takes it to 503 and through
the same restart as a dead engine process, and a model the ranks cannot split stops start-up with
one line naming the option."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from ninfer.testing.processes import engine_process_of, spawned_children
from tests.net import free_port, start_ninfer_serve
from tests.server.conftest import serve_config, start_server
from tests.server.test_engine_restart import stopped
from tests.server.test_process_lifecycle import wait_gone

pytestmark = [
    pytest.mark.slow,  # server processes of two and four ranks
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.skipif(shutil.which("ninfer-serve") is None, reason="ninfer-serve is not installed"),
]

QUESTION = [{"role": "user", "content": "Say something about prefix caching."}]
SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "request-log.schema.json").read_text())


def serve(artifact: str, *options: str) -> tuple[subprocess.Popen, str]:
    return start_ninfer_serve(artifact, *options, ready_within_s=180)  # two ranks load the model


def greedy_answers(base_url: str, model: str) -> list[tuple[str | None, dict | None, int]]:
    sdk = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    answers = []
    for max_tokens in (24, 9):
        reply = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=max_tokens, temperature=0)
        message = reply.choices[0].message
        answers.append((message.content, message.model_extra.get("reasoning_content"), reply.usage.completion_tokens))
    return answers


def test_two_ranks_answer_as_one_and_a_killed_follower_restarts_the_engine(tiny_qwen, tmp_path):
    single = start_server(serve_config(tiny_qwen, max_context=8192, prefill_chunk=8192))
    try:
        expected = greedy_answers(single.base_url, single.serving.model_id)
    finally:
        single.stop()
    assert all(tokens > 0 for *_, tokens in expected)
    request_log = tmp_path / "requests.jsonl"
    process, base = serve(tiny_qwen, "--tensor-parallel", "2", "--request-log-jsonl", str(request_log))
    try:
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        assert greedy_answers(base, model) == expected
        (start,) = [e for e in map(json.loads, request_log.read_text().splitlines()) if e["event"] == "server_start"]
        jsonschema.Draft202012Validator(SCHEMA).validate(start)
        ranks = start["tensor_parallel"]
        assert ranks["size"] == 2 and len(ranks["follower_pids"]) == 1 and len(ranks["rank_memory"]) == 2

        engine = engine_process_of(process.pid)
        (follower,) = spawned_children(engine)
        os.kill(follower, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{base}/health", timeout=5)).status_code != 503:
            assert time.monotonic() < deadline, "the follower's death was not noticed"
            time.sleep(0.05)
        reason = f"engine failed: tensor-parallel rank 1 (pid {follower}) was killed by SIGKILL"
        assert health.json()["reason"].startswith(reason)
        refused = httpx.post(f"{base}/v1/chat/completions", json={"model": model, "messages": QUESTION}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"

        deadline = time.monotonic() + 180
        while httpx.get(f"{base}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the engine was not restarted in 180 s"
            time.sleep(0.2)
        restarted = engine_process_of(process.pid)
        (restarted_follower,) = spawned_children(restarted)  # a fresh rank 0 and follower
        assert restarted != engine
        assert greedy_answers(base, model) == expected
    finally:
        process.send_signal(signal.SIGTERM)
        exit_code = stopped(process)
    assert exit_code == 0
    assert wait_gone(restarted, 5) and wait_gone(restarted_follower, 5), "a rank outlived the server"
    log = process.stderr.read()
    assert f"ERROR {reason}; restarting (attempt 1 of 3)" in log
    assert "INFO engine restarted in " in log and "tensor parallel: 2 ranks" in log


def test_two_ranks_speculating_answer_as_one_plain_process(mtp_artifact):
    """`--tensor-parallel 2 --spec mtp` (fp32: no near-tie decides a greedy token): every draft
    verified over both ranks, and the answers plain decoding's in one process."""
    single = start_server(serve_config(mtp_artifact, dtype="float32", max_context=8192, prefill_chunk=8192))
    try:
        expected = greedy_answers(single.base_url, single.serving.model_id)
    finally:
        single.stop()
    process, base = serve(mtp_artifact, "--tensor-parallel", "2", "--dtype", "float32", "--spec", "mtp",
                          "--draft-tokens", "2", "--no-adaptive-drafts")  # fmt: skip
    try:
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        assert greedy_answers(base, model) == expected
        body = {"model": model, "messages": QUESTION, "max_tokens": 16, "temperature": 0}
        timings = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()["timings"]
        assert timings["draft_n"] > 0  # rounds verified drafts (llama.cpp's counters)
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_a_model_the_ranks_cannot_split_stops_start_up_with_one_line(tiny_qwen):
    result = subprocess.run(
        ["ninfer-serve", tiny_qwen, "--port", str(free_port()), "--tensor-parallel", "4"],
        stderr=subprocess.PIPE, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"ninfer-serve: error: --tensor-parallel 4: {tiny_qwen} does not split over 4 ranks: "
        "its attention heads (2) cannot be divided among 4 ranks"
    )
