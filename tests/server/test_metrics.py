"""GET /metrics: the Prometheus observer of the request events, fed synthetic events and a real server."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ninfer.server.metrics import Metrics, token_buckets
from tests.server.conftest import serve_config, start_server, wait_until

MODEL = "tiny-model"
KEY = "sekret"


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def value(text: str, name: str, **labels: str) -> float:
    """The one sample called `name` whose labels include `labels`."""
    found = [v for n, sample_labels, v in samples(text) if n == name and labels.items() <= sample_labels.items()]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def scrape(metrics: Metrics) -> str:
    return metrics.render().decode()


def start(protocol: str = "openai_chat", stream: bool = False, prompt_tokens: int = 10) -> dict:
    return {"event": "request_start", "protocol": protocol, "stream": stream, "prompt_tokens": prompt_tokens,
            "max_output_tokens": 64}


def done(finish_reason: str = "stop", prompt_tokens: int = 10, completion_tokens: int = 4, **fields) -> dict:
    return {
        "event": "request_done",
        "protocol": "openai_chat",
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "prefix_cache_hit_tokens": 0,
        "computed_prefill_tokens": prompt_tokens,
        "prefix_reuse_path": "none",
        "timings_seconds": {"prepare": 0.001, "ttft": 0.2, "prefill": 0.15, "decode": 0.3, "total": 0.5},
        "inter_token_seconds": [0.1, 0.1, 0.1],
        **fields,
    }


def throughput(**gauges) -> dict:
    return {"event": "throughput", "prefill_tokens": 100, "decode_tokens": 20, **gauges}


# --- the observer, from synthetic events ---


def test_a_fresh_registry_exposes_every_series_at_zero_labelled_with_the_model():
    text = scrape(Metrics(MODEL, max_concurrency=2, max_model_len=1024))
    for name in (
        "ninfer:num_requests_running",
        "ninfer:num_requests_waiting",
        "ninfer:kv_cache_usage_perc",
        "ninfer:state_slots_usage_perc",
        "ninfer:prompt_tokens_total",
        "ninfer:generation_tokens_total",
        "ninfer:prefix_cache_queries_total",
        "ninfer:prefix_cache_hits_total",
        "ninfer:spec_decode_num_drafts_total",
        "ninfer:spec_decode_num_draft_tokens_total",
        "ninfer:spec_decode_num_accepted_tokens_total",
        "ninfer:time_to_first_token_seconds_count",
        "ninfer:inter_token_latency_seconds_count",
        "ninfer:e2e_request_latency_seconds_count",
        "ninfer:request_prompt_tokens_count",
        "ninfer:request_generation_tokens_count",
    ):
        assert value(text, name, model_name=MODEL) == 0.0, name
    for reason in ("stop", "length", "cancelled"):
        assert value(text, "ninfer:request_success_total", model_name=MODEL, finished_reason=reason) == 0.0
    assert all(labels.get("model_name") == MODEL for _, labels, _ in samples(text))


def test_finished_requests_fill_the_token_counters_and_latency_histograms():
    metrics = Metrics(MODEL, max_concurrency=4, max_model_len=1024)
    metrics.record(start(prompt_tokens=100))
    metrics.record(done(prompt_tokens=100, completion_tokens=7, prefix_cache_hit_tokens=64,
                        speculative={"rounds": 3, "drafted_tokens": 9, "accepted_tokens": 5}))
    metrics.record(start(prompt_tokens=30))
    metrics.record(done("length", prompt_tokens=30, completion_tokens=16,
                        timings_seconds={"ttft": 0.05, "total": 2.0}, inter_token_seconds=[0.02] * 15))
    text = scrape(metrics)
    assert value(text, "ninfer:prompt_tokens_total") == 130
    assert value(text, "ninfer:generation_tokens_total") == 23
    assert value(text, "ninfer:request_success_total", finished_reason="stop") == 1
    assert value(text, "ninfer:request_success_total", finished_reason="length") == 1
    assert value(text, "ninfer:prefix_cache_queries_total") == 130
    assert value(text, "ninfer:prefix_cache_hits_total") == 64
    assert value(text, "ninfer:spec_decode_num_drafts_total") == 3
    assert value(text, "ninfer:spec_decode_num_draft_tokens_total") == 9
    assert value(text, "ninfer:spec_decode_num_accepted_tokens_total") == 5

    assert value(text, "ninfer:time_to_first_token_seconds_count") == 2
    assert value(text, "ninfer:time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert value(text, "ninfer:time_to_first_token_seconds_bucket", le="0.05") == 1
    assert value(text, "ninfer:time_to_first_token_seconds_bucket", le="0.25") == 2
    assert value(text, "ninfer:e2e_request_latency_seconds_sum") == pytest.approx(2.5)
    assert value(text, "ninfer:inter_token_latency_seconds_count") == 18
    assert value(text, "ninfer:inter_token_latency_seconds_sum") == pytest.approx(0.6)
    assert value(text, "ninfer:inter_token_latency_seconds_bucket", le="0.02") == 15
    # The second request had no prefill/decode timings: one observation each, not two.
    assert value(text, "ninfer:request_prefill_time_seconds_count") == 1
    assert value(text, "ninfer:request_decode_time_seconds_count") == 1
    assert value(text, "ninfer:request_prompt_tokens_sum") == 130
    assert value(text, "ninfer:request_prompt_tokens_bucket", le="50.0") == 1
    assert value(text, "ninfer:request_prompt_tokens_bucket", le="100.0") == 2
    assert value(text, "ninfer:request_generation_tokens_sum") == 23


def test_a_request_without_tokens_counts_but_has_no_ttft():
    metrics = Metrics(MODEL, max_concurrency=1, max_model_len=1024)
    metrics.record(start())
    metrics.record({"event": "request_done", "finish_reason": "cancelled", "timings_seconds": {"ttft": None,
                                                                                               "total": 0.1}})
    text = scrape(metrics)
    assert value(text, "ninfer:request_success_total", finished_reason="cancelled") == 1
    assert value(text, "ninfer:time_to_first_token_seconds_count") == 0
    assert value(text, "ninfer:e2e_request_latency_seconds_count") == 1
    assert value(text, "ninfer:prompt_tokens_total") == 0


def test_requests_are_counted_by_protocol_and_streaming():
    metrics = Metrics(MODEL, max_concurrency=4, max_model_len=1024)
    for protocol, stream in (("openai_chat", True), ("openai_chat", True), ("anthropic_messages", False)):
        metrics.record(start(protocol, stream))
    text = scrape(metrics)
    assert value(text, "ninfer:requests_started_total", protocol="openai_chat", stream="true") == 2
    assert value(text, "ninfer:requests_started_total", protocol="anthropic_messages", stream="false") == 1


def test_rejections_and_errors_are_counted_by_phase_code_and_status():
    metrics = Metrics(MODEL, max_concurrency=4, max_model_len=1024)
    metrics.record({"event": "request_rejected", "phase": "prepare", "status": 400, "code": "context_length_exceeded",
                    "protocol": "openai_chat"})
    metrics.record({"event": "request_rejected", "status": 429, "code": "overloaded"})
    metrics.record(start())
    metrics.record({"event": "request_error", "phase": "generation", "status": 503, "code": "engine_unavailable"})
    metrics.record(start())
    metrics.record({"event": "request_error", "phase": "cancelled", "status": None, "code": None})
    text = scrape(metrics)
    errors = "ninfer:request_errors_total"
    assert value(text, errors, phase="prepare", code="context_length_exceeded", status="400") == 1
    assert value(text, errors, phase="prepare", code="overloaded", status="429") == 1
    assert value(text, errors, phase="generation", code="engine_unavailable", status="503") == 1
    assert value(text, errors, phase="cancelled") == 1
    assert value(text, "ninfer:num_requests_running") == 0


def test_running_and_waiting_follow_request_events_between_throughput_records():
    metrics = Metrics(MODEL, max_concurrency=2, max_model_len=1024)

    def queue() -> tuple[float, float]:
        text = scrape(metrics)
        return value(text, "ninfer:num_requests_running"), value(text, "ninfer:num_requests_waiting")

    for _ in range(3):
        metrics.record(start())
    assert queue() == (2, 1)
    metrics.record(done())  # the freed lane goes to the waiting request
    assert queue() == (2, 0)
    metrics.record(start())
    metrics.record({"event": "request_error", "phase": "admission", "status": 429, "code": "overloaded"})
    assert queue() == (2, 0)
    # The engine's record wins (fewer lanes than max_concurrency, e.g. KV pages ran out) ...
    metrics.record(throughput(running=1, waiting=1))
    assert queue() == (1, 1)
    metrics.record(done())
    metrics.record(done())
    assert queue() == (0, 0)
    # ... but a late record never brings back requests that already ended.
    metrics.record(throughput(running=2, waiting=0))
    assert queue() == (0, 0)


def test_throughput_records_set_the_cache_gauges_and_missing_fields_are_skipped():
    metrics = Metrics(MODEL, max_concurrency=2, max_model_len=1024)
    metrics.record(throughput(running=0, waiting=0, kv_pages_used=30, kv_pages_total=120, state_slots_used=1,
                              state_slots_total=4, checkpoints=5))
    metrics.record(throughput(kv_pages_used=10))  # no total: the usage stays as it was
    metrics.record({"event": "throughput"})
    metrics.record({"event": "server_start"})
    text = scrape(metrics)
    assert value(text, "ninfer:kv_cache_usage_perc") == pytest.approx(0.25)
    assert value(text, "ninfer:state_slots_usage_perc") == pytest.approx(0.25)
    assert value(text, "ninfer:prefix_cache_checkpoints") == 5


def test_each_observer_has_its_own_registry():
    first, second = Metrics("a", 1, 1024), Metrics("b", 1, 1024)
    first.record(start())
    first.record(done(prompt_tokens=5))
    assert value(scrape(first), "ninfer:prompt_tokens_total", model_name="a") == 5
    assert value(scrape(second), "ninfer:prompt_tokens_total", model_name="b") == 0


def test_token_buckets_run_1_2_5_up_to_the_context():
    assert token_buckets(1024) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]


# --- a real server ---


@pytest.fixture(scope="module")
def guarded(tiny_qwen):
    server = start_server(serve_config(tiny_qwen, model_id=MODEL, max_concurrency=2, api_key=KEY))
    yield server
    server.stop()


def get_metrics(server, **headers) -> httpx.Response:
    return httpx.get(server.base_url + "/metrics", headers=headers, timeout=30)


def test_metrics_needs_the_api_key(guarded):
    assert get_metrics(guarded).status_code == 401
    assert get_metrics(guarded, authorization="Bearer wrong").status_code == 401
    response = get_metrics(guarded, authorization=f"Bearer {KEY}")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert value(response.text, "ninfer:request_success_total", model_name=MODEL, finished_reason="stop") >= 0
    assert get_metrics(guarded, **{"x-api-key": KEY}).status_code == 200


def test_sdk_requests_are_counted(guarded):
    before = get_metrics(guarded, **{"x-api-key": KEY}).text
    client = openai.OpenAI(base_url=guarded.base_url + "/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "Say hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True,
                                                   stream_options={"include_usage": True}))[-1]
    message = anthropic.Anthropic(base_url=guarded.base_url, api_key=KEY, max_retries=0).messages.create(
        model=MODEL, max_tokens=4, messages=messages
    )
    openai_usages = [plain.usage, streamed.usage]
    # Anthropic's input_tokens leaves out the reused prefix; the metrics count whole prompts.
    cached_tokens = sum(u.prompt_tokens_details.cached_tokens for u in openai_usages)
    cached_tokens += message.usage.cache_read_input_tokens
    prompt_tokens = sum(u.prompt_tokens for u in openai_usages)
    prompt_tokens += message.usage.input_tokens + message.usage.cache_read_input_tokens
    completion_tokens = sum(u.completion_tokens for u in openai_usages) + message.usage.output_tokens

    def delta(text: str, name: str, **labels: str) -> float:
        # A labelled series appears with its first increment: absent before means zero.
        earlier = [v for n, seen, v in samples(before) if n == name and labels.items() <= seen.items()]
        return value(text, name, **labels) - sum(earlier)

    def finished(text: str) -> float:
        return sum(delta(text, "ninfer:request_success_total", finished_reason=r) for r in ("stop", "length"))

    # request_done may be recorded just after the client has read the last byte.
    wait_until(lambda: finished(get_metrics(guarded, **{"x-api-key": KEY}).text) == 3, timeout=10,
               what="three finished requests in /metrics")
    text = get_metrics(guarded, **{"x-api-key": KEY}).text
    assert delta(text, "ninfer:requests_started_total", protocol="openai_chat", stream="false") == 1
    assert delta(text, "ninfer:requests_started_total", protocol="openai_chat", stream="true") == 1
    assert delta(text, "ninfer:requests_started_total", protocol="anthropic_messages", stream="false") == 1
    assert delta(text, "ninfer:prompt_tokens_total") == prompt_tokens
    assert delta(text, "ninfer:generation_tokens_total") == completion_tokens
    assert delta(text, "ninfer:prefix_cache_queries_total") == prompt_tokens
    assert delta(text, "ninfer:prefix_cache_hits_total") == cached_tokens
    assert delta(text, "ninfer:e2e_request_latency_seconds_count") == 3
    assert delta(text, "ninfer:time_to_first_token_seconds_count") == 3
    assert delta(text, "ninfer:request_prompt_tokens_sum") == prompt_tokens
    assert value(text, "ninfer:num_requests_running") == 0
    assert value(text, "ninfer:num_requests_waiting") == 0


def test_pool_gauges_follow_the_engine_when_it_turns_idle(guarded):
    """Throughput records are off here (and never cover an idle interval): the engine's idle
    gauges alone must show what the finished requests' checkpoints still hold."""
    client = openai.OpenAI(base_url=guarded.base_url + "/v1", api_key=KEY, max_retries=0)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to three"}], max_tokens=4)

    def gauges() -> tuple[float, float, float]:
        text = get_metrics(guarded, **{"x-api-key": KEY}).text
        return (value(text, "ninfer:prefix_cache_checkpoints"), value(text, "ninfer:kv_cache_usage_perc"),
                value(text, "ninfer:state_slots_usage_perc"))

    wait_until(lambda: gauges()[0] > 0, timeout=10, what="the idle engine's checkpoint count in /metrics")
    checkpoints, kv_usage, slot_usage = gauges()
    assert 0 < kv_usage < 1
    assert 0 < slot_usage <= 1
