"""`ninfer report`: a synthetic two-run campaign with known timings gives exact counts,
percentiles and fractions; bad lines are named and skipped; a real server's log reports end to end."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import jsonschema
import numpy as np
import openai
import pytest

from ninfer.cli import main
from ninfer.report.campaign import MALFORMED, NOT_JSON, OTHER_SCHEMA, read_campaign
from ninfer.report.distribution import Distribution, percentile
from ninfer.report.summary import summarize

# One validator for every event: jsonschema.validate would check the schema itself each call.
EVENT_VALIDATOR = jsonschema.Draft202012Validator(
    json.loads((Path(__file__).parents[2] / "docs" / "request-log.schema.json").read_text()))
PLOTS = ["ttft_over_time.png", "decode_rate_over_time.png", "prefix_hit_per_request.png",
         "decode_batch_over_time.png", "host_device_per_interval.png"]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

RUN_A = "a" * 32
RUN_B = "b" * 32
T0 = 1_767_225_600_000  # 2026-01-01 00:00:00 UTC


def _envelope(event: str, instance: str, at_ms: int) -> dict:
    return {"schema": "ninfer_serve_request_log", "schema_version": 20, "event": event,
            "timestamp_unix_ms": at_ms, "server_instance_id": instance}


def server_start(instance: str, at_ms: int, model_id: str, max_concurrency: int) -> dict:
    return {
        **_envelope("server_start", instance, at_ms),
        "identity": {"model_id": model_id, "artifact": f"/models/{model_id}", "model_type": "qwen3_5_text",
                     "dtype": "auto", "weight_format": "nvfp4"},
        "sampler_defaults": {"preset": "generation defaults"},
        "sampler_overrides": {},
        "thinking": {"default_enabled": True, "supported": True, "preserve_thinking": False,
                     "default_thinking_budget": None},
        "default_max_tokens": 8192,
        "max_pending_requests": 16,
        "pending_timeout_ms": 30000,
        "capacities": {"max_concurrency": max_concurrency, "max_context": 8192, "kv_tokens": 8192, "kv_pages": 512,
                       "page_size": 16, "prefill_chunk": 2048, "mixed_prefill_chunk": 256, "device_state_slots": 2,
                       "host_state_slots": 8, "host_kv_pages": 0},
        "cuda_graph_batch_sizes": [1, 2],
        "decode_overlap": True,
        "memory": {"kv_pool": 1024, "workspace": {"capacity_bytes": 1 << 30, "source": "warm_up_peak"}},
        "host_tier": {"state_slots": 8, "state_slots_used": 0, "state_slot_bytes": 4096, "kv_pages": 0,
                      "kv_pages_used": 0, "kv_page_bytes": 8192, "pinned_bytes": 8 * 4096},
        "context_costs": {"source": "generic", "prefill_seconds_per_token": 0.001,
                          "host_transfer_bytes_per_second": 5e9},
        "device": {"type": "cuda", "name": "NVIDIA H200", "torch": "2.9.0", "cuda": "12.8"},
        "vision_workspace": None,
        "argv": ["ninfer", "serve"],
    }


def _shape() -> dict:
    return {"stream": True, "messages": 3, "tools": 0, "callable_tools": 0, "requested_max_tokens": None,
            "stop_strings": 0, "requested_reasoning_effort": None}


def request_start(instance: str, at_ms: int, seq: int, prompt_tokens: int) -> dict:
    return {
        **_envelope("request_start", instance, at_ms), "request_id": f"req-{instance[0]}{seq}", "request_seq": seq,
        "protocol": "openai_chat", **_shape(), "prompt_tokens": prompt_tokens, "max_output_tokens": 64,
        "sampler": {"temperature": 1.0, "top_p": 0.95, "min_p": 0.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "top_k": 20, "seed": None},
        "thinking": True, "enable_thinking": True, "preserve_thinking": False, "thinking_budget": None,
        "resolved_reasoning_effort": None, "capture_hints": 2, "responses_semantic_change": None,
        "media": {"items": 0, "acquisition_seconds": 0.0, "preprocess_wall_seconds": 0.0,
                  "preprocess_work_seconds": 0.0, "cache_hits": 0, "cache_misses": 0, "single_flight_waits": 0,
                  "payload_bytes": 0},
        "tokenizer": {"encode_seconds": 0.0002, "encode_calls": 2},
        "prepare_seconds": 0.001,
    }


def request_done(instance: str, at_ms: int, seq: int, *, prompt: int, hit: int, path: str, completion: int,
                 ttft: float, decode: float, total: float, gaps: list[float]) -> dict:
    return {
        **_envelope("request_done", instance, at_ms), "request_id": f"req-{instance[0]}{seq}", "request_seq": seq,
        "protocol": "openai_chat", "finish_reason": "stop", "stop_kind": "token", "prompt_tokens": prompt,
        "completion_tokens": completion, "reasoning_tokens": 0, "prefix_cache_hit_tokens": hit,
        "computed_prefill_tokens": prompt - hit, "prefix_reuse_path": path,
        "result": {"tool_call_parse": {"complete_marker_seen": False, "structured_calls": 0,
                                       "empty_non_string_arguments_omitted": 0,
                                       "schema_mismatched_arguments_preserved": 0, "fallback_reason": "none"}},
        "thinking_budget": {"max_thinking_tokens": None, "forced_close_tokens": 0},
        "materialization": None,
        "timings_seconds": {"prepare": 0.001, "queue_wait": 0.0, "ttft": ttft, "vision": 0.0, "prefill": ttft,
                            "decode": decode, "total": total},
        "inter_token_seconds": gaps,
        "engine_timing": None,
        "speculative": {"backend": None, "draft_window": None, "rounds": 0, "drafted_tokens": 0,
                        "accepted_tokens": 0, "fallback_steps": 0, "accepted_per_position": []},
    }


def _error_fields(status: int | None, code: str | None) -> dict:
    return {"status": status, "type": None if status is None else "server_error", "code": code, "param": None,
            "message": None if code is None else "it failed"}


def request_error(instance: str, at_ms: int, seq: int, phase: str, status: int | None, code: str | None) -> dict:
    return {**_envelope("request_error", instance, at_ms), "request_id": f"req-{instance[0]}{seq}",
            "request_seq": seq, "protocol": "openai_chat", **_error_fields(status, code), "phase": phase,
            "elapsed_seconds": 0.5, "configuration": _configuration(request_start(instance, at_ms, seq, 50))}


def _configuration(start: dict) -> dict:
    """The resolved configuration a request_error repeats from its request_start."""
    omitted = {"schema", "schema_version", "event", "timestamp_unix_ms", "server_instance_id", "request_id",
               "request_seq", "protocol", "media", "tokenizer", "prepare_seconds"}
    return {key: value for key, value in start.items() if key not in omitted}


def request_rejected(instance: str, at_ms: int, seq: int, code: str) -> dict:
    return {**_envelope("request_rejected", instance, at_ms), "request_id": f"req-{instance[0]}{seq}",
            "request_seq": seq, "protocol": "anthropic_messages", **_shape(), **_error_fields(400, code),
            "phase": "prepare", "resolved_reasoning_effort": None, "media_items": 0}


def context_cache(*, hits: int = 0, misses: int = 0, spills: int = 0, searches: int = 0, fallbacks: int = 0) -> dict:
    """One interval's context-cache counters: `spills` private KV spills under pressure."""
    degradation = {"private": {"state_spills": 0, "kv_spills": spills, "evictions": 0},
                   "shared": {"state_spills": 0, "kv_spills": 0, "evictions": 0}}
    return {"selection": {"hits": {"private_endpoint": hits} if hits else {}, "hit_tokens": 100 * hits,
                          "misses": misses, "historical_forks": 0},
            "capture": {"private_endpoint": hits + misses},
            "transfer": {"state_spills": 0, "state_restores": 0, "kv_spills": spills, "kv_restores": 0},
            "cow_pages": 0, "adoptions": 0, "drops": 0,
            "pressure": {"searches": searches, "stop_reasons": {"value_of_next_expansion": searches} if searches else {},
                         "budget_exhausted": 0, "maximal_root_fallbacks": fallbacks, "degradation": degradation},
            "occupancy": 1,
            "last_selection": {"target": "checkpoint", "reuse_path": "private_endpoint", "reused_tokens": 100,
                               "prompt_tokens": 120, "stop_reason": "value_of_next_expansion",
                               "budget_exhausted": False, "maximal_root_fallback": False} if hits else None}


def throughput(instance: str, at_ms: int, *, prefill: int, decode: int, rounds: int, rows: int,
               submit: float, commit: float, maintenance: float, device_wait: float, cache: dict | None = None,
               materializing: int = 0) -> dict:
    phases = {"engine_boundary": 0.0, "program_submit": submit, "program_post": 0.0,
              "engine_commit_output": commit, "engine_maintenance": maintenance}
    return {
        **_envelope("throughput", instance, at_ms), "interval_seconds": 1.0, "active_seconds": 1.0,
        "prefill_tokens": prefill, "decode_tokens": decode, "decode_rounds": rounds, "decode_row_rounds": rows,
        "average_size": rows / rounds if rounds else None, "running": 1, "prefilling": 0, "decode_ready": 1,
        "waiting": 0, "materializing": materializing, "capture_pending": 0, "terminal_pending": 0, "kv_pages_used": 4,
        "kv_pages_total": 512, "state_slots_used": 1, "state_slots_total": 2, "host_state_slots_used": 0,
        "host_state_slots_total": 8, "host_kv_pages_used": 0, "host_kv_pages_total": 0, "checkpoints": 1,
        "host_work": {
            "elapsed_seconds": {**phases, "total": sum(phases.values())},
            "device_wait_seconds": device_wait,
            "work_class_seconds": {"decode": {"host": 0.0, "device_wait": 0.0},
                                   "prefill": {"host": 0.0, "device_wait": 0.0},
                                   "control": {"host": 0.0, "device_wait": 0.0}},
            "decode_host_seconds_per_round": None, "decode_host_seconds_per_row_round": None,
            "detail_subset_seconds": {"admission": submit / 4, "context_transaction": 0.0, "replica": 0.0,
                                      "stats_publication": maintenance / 2},
            "detail_invocations": {"admission": 2, "context_transaction": 0, "replica": 0, "stats_publication": 1},
            "detail_seconds_per_invocation": {"admission": submit / 8, "context_transaction": None, "replica": None,
                                              "stats_publication": maintenance / 2},
        },
        "context_cache": cache or context_cache(),
        "request_log_dropped_events": 0,
    }


def campaign_events() -> list[dict]:
    """Run A: three finished requests (one with a single token), a failed and a cancelled one, two
    rejections, one started without an end, three throughput records. Run B starts while A's last
    record is still to come (two servers appending to one file)."""
    s = 1000
    return [
        server_start(RUN_A, T0, "model-a", 2),
        request_start(RUN_A, T0 + 1 * s, 1, 100),
        request_done(RUN_A, T0 + 2 * s, 1, prompt=100, hit=0, path="root", completion=5, ttft=0.1, decode=0.4,
                     total=0.5, gaps=[0.1] * 4),
        request_start(RUN_A, T0 + 3 * s, 2, 200),
        request_done(RUN_A, T0 + 4 * s, 2, prompt=200, hit=150, path="private_endpoint", completion=9, ttft=0.2,
                     decode=0.4, total=0.7, gaps=[0.05] * 8),
        request_start(RUN_A, T0 + 5 * s, 3, 300),
        request_done(RUN_A, T0 + 6 * s, 3, prompt=300, hit=250, path="private_endpoint", completion=1, ttft=0.4,
                     decode=0.0, total=0.45, gaps=[]),
        request_start(RUN_A, T0 + 7 * s, 4, 50),
        request_error(RUN_A, T0 + 8 * s, 4, "generation", 500, "engine_step_failed"),
        request_start(RUN_A, T0 + 9 * s, 5, 50),
        request_error(RUN_A, T0 + 10 * s, 5, "cancelled", None, None),
        request_rejected(RUN_A, T0 + 11 * s, 6, "context_length_exceeded"),
        request_rejected(RUN_A, T0 + 12 * s, 7, "context_length_exceeded"),
        request_start(RUN_A, T0 + 13 * s, 8, 50),
        throughput(RUN_A, T0 + 14 * s, prefill=600, decode=0, rounds=0, rows=0, submit=0.125, commit=0.0625,
                   maintenance=0.0625, device_wait=0.25, cache=context_cache(misses=1, hits=2, spills=3, searches=1),
                   materializing=1),
        throughput(RUN_A, T0 + 15 * s, prefill=0, decode=10, rounds=5, rows=10, submit=0.25, commit=0.125,
                   maintenance=0.125, device_wait=0.5, cache=context_cache(searches=2, fallbacks=1)),
        server_start(RUN_B, T0 + 16 * s, "model-b", 1),
        throughput(RUN_A, T0 + 17 * s, prefill=0, decode=4, rounds=4, rows=4, submit=0.125, commit=0.0625,
                   maintenance=0.0625, device_wait=0.75),
        request_start(RUN_B, T0 + 18 * s, 1, 64),
        request_done(RUN_B, T0 + 19 * s, 1, prompt=64, hit=32, path="shared_stable_prefix", completion=3, ttft=0.25,
                     decode=0.5, total=1.0, gaps=[0.25, 0.25]),
        throughput(RUN_B, T0 + 20 * s, prefill=32, decode=2, rounds=2, rows=2, submit=0.5, commit=0.0,
                   maintenance=0.0, device_wait=0.25),
    ]


def bad_lines() -> list[str]:
    """What a damaged or mixed file holds, each skipped: (kind of skip) in the comments."""
    old_version = {**campaign_events()[2], "schema_version": 19}
    missing_field = dict(campaign_events()[2])
    del missing_field["timings_seconds"]
    return [
        "this is not JSON",  # NOT_JSON
        json.dumps(old_version),  # OTHER_SCHEMA
        json.dumps({"schema": "someone_elses_log", "schema_version": 1, "event": "hello"}),  # OTHER_SCHEMA
        json.dumps([1, 2]),  # OTHER_SCHEMA
        json.dumps(missing_field),  # MALFORMED
    ]


@pytest.fixture
def campaign_file(tmp_path) -> Path:
    events = campaign_events()
    for event in events:
        EVENT_VALIDATOR.validate(event)
    lines = [json.dumps(event, separators=(",", ":")) for event in events]
    lines[3:3] = bad_lines()  # lines 4-8
    truncated = lines[-1][: len(lines[-1]) // 2]  # a run killed mid-write: line 27, not JSON
    path = tmp_path / "campaign.jsonl"
    path.write_text("\n".join([*lines[:-1], "", truncated]) + "\n")  # line 26 is blank: not counted
    return path


def test_percentiles_interpolate_linearly_like_numpy():
    rng = random.Random(7)
    for size in (1, 2, 3, 10, 101):
        values = sorted(rng.uniform(0, 5) for _ in range(size))
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12, abs=1e-15)
    assert Distribution.of([]) == Distribution(0, None, None, None)
    assert Distribution.of([3.0, 1.0]) == Distribution(2, 2.0, pytest.approx(2.8), pytest.approx(2.98))


def test_the_campaign_groups_by_server_instance_and_counts_what_it_skips(campaign_file):
    campaign = read_campaign(campaign_file)
    assert [run.instance_id for run in campaign.runs] == [RUN_A, RUN_B]
    assert campaign.lines_read == 27 and campaign.events_read == 20  # run B's throughput record was cut in half
    assert [(line.line_number, line.kind) for line in campaign.skipped] == [
        (4, NOT_JSON), (5, OTHER_SCHEMA), (6, OTHER_SCHEMA), (7, OTHER_SCHEMA), (8, MALFORMED), (27, NOT_JSON)]
    assert "version 19" in campaign.skipped[1].reason
    assert "timings_seconds" in campaign.skipped[4].reason
    run_a, run_b = campaign.runs
    assert len(run_a.throughput) == 3 and len(run_b.throughput) == 0
    assert run_b.origin_unix_ms == T0 + 16_000


def test_run_summary_counts_percentiles_and_fractions(campaign_file):
    run_a, run_b = (summarize(run) for run in read_campaign(campaign_file).runs)
    assert (run_a.model_id, run_a.device, run_a.start_unix_ms) == ("model-a", "cuda (NVIDIA H200)", T0)
    assert run_a.capacities["max_concurrency"] == 2
    assert (run_a.started, run_a.done, run_a.without_terminal) == (6, 3, 1)
    assert run_a.errors == {("generation", "engine_step_failed"): 1, ("cancelled", None): 1}
    assert run_a.rejected == {"context_length_exceeded": 2}

    assert run_a.ttft_seconds == Distribution(3, 0.2, pytest.approx(0.36, rel=1e-12), pytest.approx(0.396, rel=1e-12))
    assert run_a.e2e_seconds == Distribution(3, 0.5, pytest.approx(0.66, rel=1e-12), pytest.approx(0.696, rel=1e-12))
    assert run_a.inter_token_seconds == Distribution(12, 0.05, 0.1, 0.1)  # 8 gaps of 50 ms, 4 of 100 ms
    assert run_a.inter_token_requests == 2
    # (5-1)/0.4 and (9-1)/0.4; the one-token request has no decode rate
    assert run_a.decode_tokens_per_second == Distribution(2, 15.0, pytest.approx(19.0), pytest.approx(19.9))

    assert (run_a.prompt_tokens, run_a.prefix_hit_tokens) == (600, 400)
    assert run_a.prefix_hit_fraction == pytest.approx(2 / 3, rel=1e-15)
    paths = {path: (r.requests, r.prompt_tokens, r.hit_tokens, r.hit_fraction) for path, r in run_a.reuse_paths.items()}
    assert paths == {"private_endpoint": (2, 500, 400, 0.8), "root": (1, 100, 0, 0.0)}

    totals = run_a.throughput
    assert (totals.records, totals.prefill_tokens, totals.decode_tokens) == (3, 600, 14)
    assert (totals.batch_records, totals.mean_average_size) == (2, 1.5)
    assert totals.rows_per_round == 14 / 9
    assert (totals.host_seconds, totals.device_wait_seconds) == (1.0, 1.5)
    assert totals.host_phase_seconds == {"engine_boundary": 0.0, "program_submit": 0.5, "program_post": 0.0,
                                         "engine_commit_output": 0.25, "engine_maintenance": 0.25}
    assert totals.detail_seconds["admission"] == 0.125 and totals.detail_invocations["admission"] == 6

    cache = run_a.cache
    assert (cache.records, cache.hits, cache.hit_tokens, cache.misses) == (3, {"private_endpoint": 2}, 200, 1)
    assert (cache.kv_spills, cache.pressure_searches, cache.maximal_root_fallbacks) == (3, 3, 1)
    assert cache.stop_reasons == {"value_of_next_expansion": 3}
    assert cache.degradation["private"] == {"state_spills": 0, "kv_spills": 3, "evictions": 0}
    assert (cache.peak_materializing, cache.peak_capture_pending) == (1, 0)
    assert cache.last_selection.target == "checkpoint" and cache.last_selection.reused_tokens == 100

    assert (run_b.model_id, run_b.started, run_b.done, run_b.errors, run_b.rejected) == ("model-b", 1, 1, {}, {})
    assert run_b.decode_tokens_per_second == Distribution(1, 4.0, 4.0, 4.0)
    assert run_b.throughput.records == 0 and run_b.throughput.mean_average_size is None


def test_report_writes_the_markdown_tables_and_the_plots(campaign_file, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["report", str(campaign_file), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    markdown = (out / "report.md").read_text()
    assert markdown in captured.out
    for expected in [
        "27 lines, 20 events read, 6 lines skipped (2 not JSON, 3 another schema or version, 1 malformed event); "
        "2 server runs.",
        "## Run 1: model-a",
        "Started 2026-01-01 00:00:00 UTC; instance `" + RUN_A + "`, device cuda (NVIDIA H200), dtype auto, "
        "weights nvfp4.",
        "| max_concurrency | 2 |",
        "| outcome | requests |\n|---|---|\n| started | 6 |\n| done | 3 |\n"
        "| error: generation, engine_step_failed | 1 |\n| error: cancelled, no code | 1 |\n"
        "| rejected: context_length_exceeded | 2 |\n| started without an end in the file | 1 |",
        "| metric | samples | p50 | p90 | p99 |\n|---|---|---|---|---|\n"
        "| TTFT (ms) | 3 | 200.0 | 360.0 | 396.0 |\n"
        "| end to end (ms) | 3 | 500.0 | 660.0 | 696.0 |\n"
        "| inter-token (ms) | 12 gaps in 2 requests | 50.0 | 100.0 | 100.0 |\n"
        "| decode rate per request (tok/s) | 2 | 15.0 | 19.0 | 19.9 |",
        "600 prompt tokens, 400 of them reused from the prefix cache (hit fraction 0.667, 3 requests)",
        "| reuse path | requests | prompt tokens | hit tokens | hit fraction |\n|---|---|---|---|---|\n"
        "| private_endpoint | 2 | 500 | 400 | 0.800 |\n| root | 1 | 100 | 0 | 0.000 |",
        "3 records over 3.00 s, the engine active 3.00 s of it.",
        "| prefill tokens | 600 |\n| decode tokens | 14 |\n"
        "| decode batch: mean of the records' average_size | 1.50 (2 records with decode rounds) |\n"
        "| decode batch: row-rounds / rounds | 1.56 (9 rounds) |\n"
        "| host active (s) | 1.000 |\n| device wait (s) | 1.500 |",
        "| program_submit | 0.500 | 50.0% |\n| program_post | 0.000 | 0.0% |\n| engine_commit_output | 0.250 | 25.0% |",
        "| slow path | seconds | invocations | ms per invocation |\n|---|---|---|---|\n"
        "| admission | 0.125 | 6 | 20.833 |",
        "### Context cache (throughput records)",
        "| admissions resuming a checkpoint | 2 (private_endpoint 2), 200 tokens |\n| admissions from the root | 1 |",
        "| KV spills / restores | 3 / 0 |",
        "| pressure searches | 3 (value_of_next_expansion 3) |",
        "| root fallbacks despite a hit | 1 |",
        "| pressure on private checkpoints: state spills, KV spills, evictions | 0, 3, 0 |",
        "| peak materializing / capture pending | 1 / 0 |",
        "| last selection | checkpoint (private_endpoint), 100 of 120 tokens reused, value_of_next_expansion |",
        "## Run 2: model-b",
        "| decode rate per request (tok/s) | 1 | 4.0 | 4.0 | 4.0 |",
        "No throughput records",
    ]:
        assert expected in markdown
    assert f"{campaign_file}:4: not JSON" in captured.err
    assert f"{campaign_file}:8: malformed event (request_done: Object missing required field `timings_seconds`)" \
        in captured.err
    assert f"{campaign_file}:27: not JSON" in captured.err
    if HAS_MATPLOTLIB:
        assert "wrote 5 plots" in captured.out
        for name in PLOTS:
            assert (out / name).read_bytes().startswith(b"\x89PNG")


def test_without_matplotlib_the_markdown_is_still_written(campaign_file, tmp_path, capsys, monkeypatch):
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    assert main(["report", str(campaign_file)]) == 0  # default --out: next to the log
    out = campaign_file.parent / "campaign-report"
    assert (out / "report.md").is_file() and not list(out.glob("*.png"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "plots need `pip install ninfer[report]` (matplotlib); only the markdown was written"


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().err == f"ninfer report: error: {tmp_path / 'missing.jsonl'}: no such file\n"
    assert main(["report", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err

    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b'{"half": \n\xff\xfe\n[]\n')
    assert main(["report", str(garbage)]) == 1
    err = capsys.readouterr().err
    assert f"{garbage}:1: not JSON" in err and f"{garbage}:2: not JSON (not UTF-8 text)" in err
    assert f"{garbage}:3: another schema or version" in err
    assert f"{garbage} holds no request-log events (3 lines, 3 skipped)" in err
    assert "Traceback" not in err

    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(campaign_events()[0]) + "\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["report", str(good), "--out", str(blocker)]) == 1
    assert f"cannot write the report into {blocker}" in capsys.readouterr().err


def test_report_on_a_real_server_log(tmp_path, tmp_path_factory, capsys):
    """A short real run (tiny model, CPU): two turns of one conversation and a rejection."""
    from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
    from tests.server.conftest import serve_config, start_server

    # The cache root tests/bench uses: the artifact is built once per session.
    artifact = str(make_tiny_qwen3_5(tmp_path_factory.getbasetemp() / "artifacts"))
    log_path = tmp_path / "serve.jsonl"
    server = start_server(serve_config(artifact, max_context=512, log_stats_interval_ms=1,
                                       request_log_jsonl=str(log_path)))
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        model = server.serving.model_id
        messages = [{"role": "user", "content": "hello there"}]
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=4)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "and then?"}]
        client.chat.completions.create(model=model, messages=messages, max_tokens=4)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "word " * 600}])
    finally:
        server.stop()
        server.serving.events.close()  # the writer thread drains its queue into the file
    assert main(["report", str(log_path)]) == 0
    out = tmp_path / "serve-report"
    markdown = (out / "report.md").read_text()
    assert f"## Run 1: {model}" in markdown and "1 server run." in markdown
    assert "| started | 2 |\n| done | 2 |\n| rejected: context_length_exceeded | 1 |" in markdown
    assert "| TTFT (ms) | 2 |" in markdown and "gaps in 2 requests |" in markdown
    assert "records over" in markdown and "0 lines skipped" in markdown
    assert "### Context cache (throughput records)" in markdown and "| admissions from the root |" in markdown
    assert markdown in capsys.readouterr().out
    if HAS_MATPLOTLIB:
        assert sorted(path.name for path in out.glob("*.png")) == sorted(PLOTS)
