"""The measurement events (--request-log-jsonl): every event matches docs/request-log.schema.json,
every started request has exactly one terminal, preparation rejections have no start, and no
prompt or output text reaches the log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from ninfer.server.request_log import open_request_log
from tests.net import free_port
from tests.server.conftest import fail_next_launch, serve_config, start_server, wait_until

SCHEMA = json.loads((Path(__file__).parents[2] / "docs" / "request-log.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)  # checked once, not per event
SECRET_WORDS = "zebra quantum marmalade"  # in every prompt: must never reach the log


class Collect:
    def __init__(self):
        self.events: list[dict] = []

    def record(self, event: dict) -> None:
        self.events.append(json.loads(json.dumps(event)))  # what the file would hold

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def campaign(tiny_qwen, tmp_path_factory):
    """All three APIs: successes, streams, a preparation rejection, a cancelled stream, a failed step."""
    log_path = tmp_path_factory.mktemp("request-log") / "campaign.jsonl"
    server = start_server(serve_config(tiny_qwen, max_concurrency=2, max_context=512, log_stats_interval_ms=1,
                                       default_max_tokens=8))
    collect = Collect()
    written = open_request_log(str(log_path), tiny_qwen)
    server.serving.events.observers.extend([collect, written])
    server.serving.engine.on_stats = lambda record: server.serving.events.emit("throughput", record)
    server.serving.record_server_start()
    model = server.serving.model_id
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": f"say {SECRET_WORDS}"}]
    try:
        chat.chat.completions.create(model=model, messages=messages, max_tokens=6)
        for _ in chat.chat.completions.create(model=model, messages=messages, max_tokens=6, stream=True):
            pass
        chat.responses.create(model=model, input=f"tell {SECRET_WORDS}", max_output_tokens=6)
        claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
        claude.messages.create(model="any", max_tokens=6, messages=[{"role": "user", "content": SECRET_WORDS}])
        with pytest.raises(openai.BadRequestError):  # a schema rejection: not a measurement request
            chat.chat.completions.create(model=model, messages=messages, max_tokens=-1)
        with pytest.raises(openai.BadRequestError):  # beyond the context ceiling: rejected in preparation
            chat.chat.completions.create(model=model, messages=[{"role": "user", "content": SECRET_WORDS * 200}])
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=30,
                          json={"model": model, "messages": messages, "max_tokens": 200, "stream": True}) as response:
            for _ in response.iter_lines():
                break  # the client goes away mid-stream
        # Until its cancellation lands, that request's steps would take the injected fault instead.
        wait_until(lambda: server.core.pool_accounting()["running"] == 0, what="the cancelled stream's end")
        fail_next_launch(server)
        with pytest.raises(openai.InternalServerError):
            chat.chat.completions.create(model=model, messages=messages, max_tokens=6)
        wait_until(lambda: sum(e["event"] in ("request_done", "request_error") for e in collect.events) >= 6,
                   what="every terminal event")
        time.sleep(0.2)  # the last throughput record
    finally:
        server.stop()
        written.close()
    return collect.events, log_path


def by_event(events, name):
    return [e for e in events if e["event"] == name]


def test_every_event_matches_the_schema_and_the_file_holds_them_all(campaign):
    events, log_path = campaign
    for event in events:
        VALIDATOR.validate(event)
    lines = log_path.read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == [e["event"] for e in events]
    assert len({e["server_instance_id"] for e in events}) == 1


def test_one_start_and_one_terminal_per_started_request_and_no_start_for_rejections(campaign):
    events, _ = campaign
    starts = {e["request_id"] for e in by_event(events, "request_start")}
    terminals = [e["request_id"] for e in events if e["event"] in ("request_done", "request_error")]
    rejected = {e["request_id"] for e in by_event(events, "request_rejected")}
    assert len(terminals) == len(set(terminals)) and set(terminals) == starts
    assert len(rejected) == 1 and not rejected & starts
    (rejection,) = by_event(events, "request_rejected")
    assert rejection["status"] == 400 and rejection["code"] == "context_length_exceeded"
    assert rejection["param"] == "messages" and "context ceiling" in rejection["message"]
    seqs = [e["request_seq"] for e in events if e["event"] in ("request_start", "request_rejected")]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    protocols = {e["protocol"] for e in by_event(events, "request_done")}
    assert protocols == {"openai_chat", "openai_responses", "anthropic_messages"}
    phases = sorted(e["phase"] for e in by_event(events, "request_error"))
    assert phases == ["cancelled", "generation"]
    failed = next(e for e in by_event(events, "request_error") if e["phase"] == "generation")
    assert failed["code"] == "engine_step_failed" and failed["status"] == 500


def test_server_start_reports_the_weight_format_workspace_and_host_tier(campaign):
    events, _ = campaign
    (start,) = by_event(events, "server_start")
    # The tiny model on the CPU: float32 compute, Linear weights stored in float16 for decode.
    assert start["identity"]["weight_format"] == "float16" and start["identity"]["dtype"] == "auto"
    assert start["memory"]["workspace"] == {"capacity_bytes": None, "source": "not_measured"}
    assert start["vision_workspace"] is None
    host = start["host_tier"]
    capacities = start["capacities"]
    assert (host["state_slots"], host["kv_pages"]) == (capacities["host_state_slots"], capacities["host_kv_pages"])
    assert host["state_slots_used"] == host["kv_pages_used"] == 0
    assert host["state_slot_bytes"] > 0 and host["kv_page_bytes"] > 0
    assert host["pinned_bytes"] == host["state_slots"] * host["state_slot_bytes"] + host["kv_pages"] * host["kv_page_bytes"]


def test_an_error_repeats_the_configuration_its_request_started_with(campaign):
    events, _ = campaign
    starts = {e["request_id"]: e for e in by_event(events, "request_start")}
    errors = by_event(events, "request_error")
    assert sorted(e["phase"] for e in errors) == ["cancelled", "generation"]
    for error in errors:
        start = starts[error["request_id"]]
        configuration = error["configuration"]
        assert configuration == {key: start[key] for key in configuration}
        assert {"sampler", "max_output_tokens", "prompt_tokens", "resolved_reasoning_effort"} <= set(configuration)
        assert isinstance(configuration["sampler"]["seed"], int)


def test_thinking_on_a_template_without_tiers_resolves_to_no_tier(campaign):
    events, _ = campaign
    for start in by_event(events, "request_start"):
        assert start["requested_reasoning_effort"] is None
        assert start["resolved_reasoning_effort"] == (None if start["thinking"] else "none")
    assert any(start["thinking"] for start in by_event(events, "request_start"))


def test_done_records_add_up(campaign):
    events, _ = campaign
    for done in by_event(events, "request_done"):
        assert done["prompt_tokens"] == done["prefix_cache_hit_tokens"] + done["computed_prefill_tokens"]
        assert done["completion_tokens"] == 6
        assert len(done["inter_token_seconds"]) <= done["completion_tokens"] - 1
        host = done["engine_timing"]["host_exposed_seconds"]
        assert host["total"] == pytest.approx(sum(v for k, v in host.items() if k != "total"), abs=1e-12)
        timings = done["timings_seconds"]
        assert 0 <= timings["prepare"] <= timings["ttft"] <= timings["total"]
        # The admission decision: what it reused is what the usage reports, its costs add up.
        decision = done["materialization"]
        assert decision["reused_tokens"] == done["prefix_cache_hit_tokens"]
        assert (decision["target"] == "root") == (done["prefix_cache_hit_tokens"] == 0)
        assert decision["predicted_total_ns"] == decision["predicted_immediate_ns"] + decision["predicted_future_loss_ns"]
        # Recompute is predicted for every computed token (a restore from the host tier may add to it).
        assert decision["predicted_immediate_ns"] > 0 or done["computed_prefill_tokens"] == 0
        assert decision["planning_ns"] > 0


def test_throughput_counts_the_tokens_the_requests_computed(campaign):
    events, _ = campaign
    throughput = by_event(events, "throughput")
    assert throughput
    done = by_event(events, "request_done")
    decode_tokens = sum(e["decode_tokens"] for e in throughput)
    # Each finished request decoded all but its first token; the cancelled and failed ones some more.
    assert decode_tokens >= sum(d["completion_tokens"] - 1 for d in done)
    prefill = sum(e["prefill_tokens"] for e in throughput)
    assert prefill >= sum(d["computed_prefill_tokens"] for d in done)
    for record in throughput:
        host = record["host_work"]["elapsed_seconds"]
        assert host["total"] == pytest.approx(sum(v for k, v in host.items() if k != "total"), abs=1e-12)


def test_no_prompt_or_output_text_reaches_the_log(campaign):
    _, log_path = campaign
    text = log_path.read_text()
    for word in SECRET_WORDS.split():
        assert word not in text


def test_a_log_path_that_cannot_be_used_stops_start_up(tiny_qwen, tmp_path):
    base = [sys.executable, "-m", "ninfer.cli", "serve", tiny_qwen, "--port", str(free_port())]
    for path, reason in [(tmp_path / "missing" / "log.jsonl", "does not exist"),
                         (Path(tiny_qwen) / "log.jsonl", "inside the model artifact")]:
        result = subprocess.run([*base, "--request-log-jsonl", str(path)], capture_output=True, text=True, timeout=120,
                                env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert result.returncode == 2, result.stderr
        assert "--request-log-jsonl" in result.stderr and reason in result.stderr


@pytest.mark.slow
def test_the_real_server_writes_server_start_with_the_key_redacted(tiny_qwen, tmp_path):
    log_path = tmp_path / "serve.jsonl"
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "ninfer.cli", "serve", tiny_qwen, "--port", str(port), "--api-key", "sekrit-value",
         "--request-log-jsonl", str(log_path), "--log-stats-interval-ms", "100"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: _healthy(port), timeout=120, what="the server")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sekrit-value", max_retries=0)
        model = client.models.list().data[0].id
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        wait_until(lambda: '"throughput"' in log_path.read_text(), timeout=30, what="a throughput record")
    finally:
        process.terminate()
        process.wait(60)
    events = [json.loads(line) for line in log_path.read_text().splitlines()]
    for event in events:
        VALIDATOR.validate(event)
    start = events[0]
    assert start["event"] == "server_start" and start["capacities"]["max_concurrency"] == 1
    assert "<redacted>" in start["argv"] and "sekrit-value" not in log_path.read_text()
    assert [e["event"] for e in events if e["event"].startswith("request")] == ["request_start", "request_done"]




def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
