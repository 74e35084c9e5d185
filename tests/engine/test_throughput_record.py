"""The throughput record's context-cache counters, gauges and host detail on a real hybrid model
(CPU): a KV pool for about one conversation and a one-slot host tier force pressure, spills,
restores and a root fallback, and each counter moves in the interval its event happens in.
Records are closed by a fake clock, at idle boundaries as the engine loop closes them, or while
a chosen step computes."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from ninfer.config import EngineConfig
from ninfer.contract.request import EngineRequest
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.engine.scheduler import admission
from ninfer.server.request_events import SCHEMA, SCHEMA_VERSION
from tests.engine.test_engine_generation import _models
from tests.unit.conftest import make_byte_tokenizer

VALIDATOR = jsonschema.Draft202012Validator(
    json.loads((Path(__file__).parents[2] / "docs" / "request-log.schema.json").read_text())
)
KV_TOKENS = 160  # ten pages: one conversation and a bit
FIRST = "Tell me about the weather on the coast of Maine please. Answer:"  # 63 tokens: a partial last page
ALIGNED = "Tell me about the weather on the coast of Maine, please. Answer:"  # 64 tokens: four whole pages
OTHER = "Something entirely different about trains and stations. Go:"


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def greedy(request_id: str, prompt: list[int], max_new: int) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(temperature=0.0), max_new_tokens=max_new)


class Clocked:
    """An EngineCore on a fake clock: records close only when the test moves the clock."""

    def __init__(self, model, host_state_slots: int = 1):
        self.now = 0.0
        config = EngineConfig(max_concurrency=1, max_context=256, kv_capacity=KV_TOKENS, page_size=16,
                              device_state_slots=1, host_state_slots=host_state_slots, host_kv_mib=1,
                              log_stats_interval_ms=1000, prefill_chunk=64)
        self.core = EngineCore(model, make_byte_tokenizer(), config, clock=lambda: self.now)

    def run(self, request: EngineRequest, record_at_first_step: bool = False) -> list:
        """Serve one request to the end; its outputs. record_at_first_step: the interval closes
        while the step that admits it computes."""
        assert not self.core.add_request(request)
        outputs = []
        first = True
        while self.core.has_work:
            if first and record_at_first_step:
                self.now += 2.0
            first = False
            outputs += [out for out in self.core.step() if out.request_id == request.request_id]
        return outputs

    def close(self) -> list[dict]:
        """Close the interval at an idle boundary (as the engine loop does); the records since the last call."""
        self.now += 2.0
        self.core.log_stats_if_due()
        return self.core.take_stats_records()


def tokens(outputs) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def validate(record: dict) -> None:
    VALIDATOR.validate({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "event": "throughput",
                        "timestamp_unix_ms": 0, "server_instance_id": "0" * 32, **record})


def pressure_adds_up(cache: dict) -> None:
    """Pressure's per-owner degradation is part of the transfer and drop counters."""
    owners = cache["pressure"]["degradation"].values()
    assert sum(o["kv_spills"] for o in owners) <= cache["transfer"]["kv_spills"]
    assert sum(o["state_spills"] for o in owners) <= cache["transfer"]["state_spills"]
    assert sum(o["evictions"] for o in owners) <= cache["drops"]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return _models("qwen3_5", str(tmp_path_factory.mktemp("throughput-models")))[1]


@pytest.fixture(scope="module")
def story(hybrid):
    """A: one conversation alone. B: another that pushes A's checkpoints to the host tier. C: A's
    next turn filling the KV pool exactly, so its hit (restored into pages with a partial last
    page, one more than the root needs) cannot fit and the plan falls back to the root. D: B's
    next turn, resumed from the host tier. E: D's prompt again with no output, a cache hit and no
    token computed. The records of each step, and the final outputs."""
    engine = Clocked(hybrid)
    records, finals = {}, {}
    a = engine.run(greedy("a", ids(FIRST), 4))
    records["a"] = engine.close()
    b = engine.run(greedy("b", ids(OTHER), 30))
    records["b"] = engine.close()
    c_prompt = ids(FIRST) + tokens(a) + ids(" And more?")
    c = engine.run(greedy("c", c_prompt, KV_TOKENS - len(c_prompt)), record_at_first_step=True)
    records["c_admission"] = engine.core.take_stats_records()
    records["c"] = engine.close()
    d_prompt = ids(OTHER) + tokens(b)[:-1]  # B's endpoint: its last token was never computed
    d = engine.run(greedy("d", d_prompt, 3), record_at_first_step=True)
    records["d_admission"] = engine.core.take_stats_records()
    records["d"] = engine.close()
    e = engine.run(greedy("e", d_prompt, 0))
    records["e"] = engine.close()
    for name, outputs in zip("abcde", (a, b, c, d, e), strict=True):
        finals[name] = outputs[-1]
    return records, finals


def test_every_record_matches_the_schema(story):
    records, _ = story
    assert all(len(r) == 1 for r in records.values()), {k: len(v) for k, v in records.items()}
    for (record,) in records.values():
        validate(record)
        pressure_adds_up(record["context_cache"])
        host = record["host_work"]
        # The detail paths are a subset of the host phases, never part of their total.
        assert sum(host["detail_subset_seconds"].values()) <= host["elapsed_seconds"]["total"] + 1e-9
        for name, count in host["detail_invocations"].items():
            per = host["detail_seconds_per_invocation"][name]
            assert (per is None) == (count == 0)


def test_a_lone_conversation_misses_and_captures_without_pressure(story):
    records, _ = story
    (record,) = records["a"]
    cache = record["context_cache"]
    assert cache["selection"]["misses"] == 1 and not cache["selection"]["hits"]
    assert sum(cache["capture"].values()) >= 1
    assert cache["pressure"]["searches"] == 0 and cache["transfer"]["kv_spills"] == 0
    assert cache["last_selection"]["target"] == "root" and cache["last_selection"]["stop_reason"] == "no_pressure"
    assert record["host_work"]["detail_invocations"]["admission"] == 1
    assert record["host_work"]["detail_invocations"]["context_transaction"] >= 1


def test_kv_pressure_searches_spills_and_evicts_private_checkpoints(story):
    records, finals = story
    (record,) = records["b"]
    cache = record["context_cache"]
    pressure = cache["pressure"]
    assert pressure["searches"] == 1
    assert pressure["stop_reasons"] == {finals["b"].materialization.stop_reason: 1}
    private = pressure["degradation"]["private"]
    assert private["kv_spills"] == cache["transfer"]["kv_spills"] >= 1
    assert private["state_spills"] == cache["transfer"]["state_spills"] >= 1
    assert pressure["degradation"]["shared"] == {"state_spills": 0, "kv_spills": 0, "evictions": 0}
    assert record["host_work"]["detail_invocations"]["replica"] >= 2  # the spills' copies to the host tier


def test_a_hit_that_cannot_fit_falls_back_to_the_root_and_the_record_sees_it_materializing(story):
    records, finals = story
    decision = finals["c"].materialization
    assert decision.maximal_root_fallback and decision.target == "root"
    (record,) = records["c_admission"]  # closed while C's first step computes
    assert record["materializing"] == 1  # its plan spills victims before that step
    assert record["capture_pending"] == 1  # its prompt end is still ahead
    cache = record["context_cache"]
    assert cache["pressure"]["maximal_root_fallbacks"] == 1
    assert cache["last_selection"]["maximal_root_fallback"] and cache["last_selection"]["prompt_tokens"] > 0
    (later,) = records["c"]
    assert later["materializing"] == 0 and later["capture_pending"] == 0
    assert later["context_cache"]["pressure"]["maximal_root_fallbacks"] == 0


def test_a_resume_from_the_host_tier_restores_and_materializes(story):
    records, finals = story
    assert finals["d"].cached_tokens > 0
    (record,) = records["d_admission"]
    cache = record["context_cache"]
    assert cache["selection"]["hits"] == {"private_endpoint": 1}
    assert cache["transfer"]["state_restores"] + cache["transfer"]["kv_restores"] >= 1
    assert record["materializing"] == 1
    assert cache["last_selection"]["target"] == "checkpoint"
    assert cache["last_selection"]["reused_tokens"] == finals["d"].cached_tokens


def test_an_interval_with_cache_work_and_no_tokens_is_reported(story):
    records, finals = story
    assert finals["e"].cached_tokens == finals["e"].prompt_tokens and finals["e"].completion_tokens == 0
    (record,) = records["e"]
    assert record["prefill_tokens"] == 0 and record["decode_tokens"] == 0
    selection = record["context_cache"]["selection"]
    assert selection["hits"] == {"private_endpoint": 1}
    # D's turn went on past the checkpoint E resumes: E branches off an older turn.
    assert selection["historical_forks"] == 1


def test_a_fully_idle_interval_is_not_reported(hybrid):
    engine = Clocked(hybrid)
    engine.run(greedy("a", ids(FIRST), 2))
    assert len(engine.close()) == 1
    assert engine.core.seconds_to_stats_boundary() is None
    assert engine.close() == []


def next_turn_decision(model, first: str, host_state_slots: int):
    """A's next turn after B's pressure, filling the KV pool; its admission decision and the record
    closed while that admission's step computes."""
    engine = Clocked(model, host_state_slots)
    a = engine.run(greedy("a", ids(first), 4))
    engine.run(greedy("b", ids(OTHER), 30))
    engine.close()
    prompt = ids(first) + tokens(a) + ids(" And more?")
    c = engine.run(greedy("c", prompt, KV_TOKENS - len(prompt)), record_at_first_step=True)
    (record,) = engine.core.take_stats_records()
    validate(record)
    return c[-1].materialization, record


def test_a_hit_that_cannot_fit_gives_way_to_a_shorter_hit_before_the_root(hybrid):
    # A's endpoint (67 tokens, its KV on the host tier) would come back into one page more than
    # the pool has; A's prompt end (64 tokens, four whole pages on the device) fits.
    decision, record = next_turn_decision(hybrid, ALIGNED, host_state_slots=2)
    assert decision.target == "checkpoint" and decision.reused_tokens == len(ALIGNED)
    assert decision.evaluated_targets == 2 and not decision.maximal_root_fallback
    assert record["context_cache"]["selection"]["hits"] == {"private_endpoint": 1}


def test_the_reuse_target_budget_sends_the_search_to_the_root(hybrid, monkeypatch):
    monkeypatch.setattr(admission, "MAX_REUSE_TARGETS", 1)
    decision, record = next_turn_decision(hybrid, ALIGNED, host_state_slots=2)
    assert decision.target == "root" and decision.maximal_root_fallback
    assert decision.stop_reason == "target_budget" and decision.budget_exhausted
    pressure = record["context_cache"]["pressure"]
    assert pressure["stop_reasons"] == {"target_budget": 1}
    assert pressure["budget_exhausted"] == 1 and pressure["maximal_root_fallbacks"] == 1


def pressure_decision(model) -> tuple:
    """B's admission under A's checkpoints: its decision, and how many checkpoints there were."""
    engine = Clocked(model)
    engine.run(greedy("a", ids(FIRST), 4))
    held = len(engine.core.cache)
    b = engine.run(greedy("b", ids(OTHER), 30))
    (record,) = engine.close()
    validate(record)
    return b[-1].materialization, held, record


def test_the_expansion_capacity_projects_the_whole_queue_at_once(hybrid, monkeypatch):
    unbounded, held, _ = pressure_decision(hybrid)
    assert unbounded.stop_reason == "value_of_next_expansion" and not unbounded.budget_exhausted
    monkeypatch.setattr(admission, "MAX_EXPANSIONS", 0)
    bounded, held, record = pressure_decision(hybrid)
    assert bounded.stop_reason == "expansion_capacity" and bounded.budget_exhausted
    units = bounded.degradation_units
    assert units.dropped + units.kv_spilled >= held  # every checkpoint gave up its device pages
    assert record["context_cache"]["pressure"]["stop_reasons"] == {"expansion_capacity": 1}
    assert record["context_cache"]["pressure"]["budget_exhausted"] == 1


def test_the_time_budget_cuts_the_search_short(hybrid, monkeypatch):
    monkeypatch.setattr(admission, "PLANNING_BUDGET_NS", -1)  # spent before the search begins
    decision, _, record = pressure_decision(hybrid)
    assert decision.stop_reason == "time_budget" and decision.budget_exhausted
    assert record["context_cache"]["pressure"]["stop_reasons"] == {"time_budget": 1}
