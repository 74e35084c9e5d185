"""The context cache's interval counters (throughput.context_cache) as the scheduler moves them:
pressure degradation by owner, adoptions, the last-selection gauge and what take() resets."""

from __future__ import annotations

from ninfer.contract.request import CaptureHint
from ninfer.engine.cache.cache_counters import CacheCounters
from tests.unit.test_scheduler import Harness, _conversation, _next_turn, req


def test_pressure_on_a_shared_prefix_counts_under_its_owner(byte_tokenizer):
    # A KV pool for one conversation: the second one's admission evicts the first's checkpoints,
    # a shared prefix among them.
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=2, kv_tokens=96, page_size=8)
    first = _conversation("first")
    h.add(req("a", first, max_new=3, capture_hints=[CaptureHint(16, "shared_stable_prefix")]))
    h.run()
    assert any(ck.shared for ck in h.cache.checkpoints.values())
    h.cache.counters.take(len(h.cache))
    h.add(req("b", _conversation("other"), max_new=30))
    h.run()
    record = h.cache.counters.take(len(h.cache))
    pressure = record["pressure"]
    assert pressure["searches"] == 1
    assert pressure["degradation"]["shared"]["evictions"] == 1
    assert pressure["degradation"]["private"]["evictions"] >= 1
    evictions = sum(owner["evictions"] for owner in pressure["degradation"].values())
    assert evictions == record["drops"] == h.final("b").materialization.degradation_units.dropped


def test_an_adopted_checkpoint_is_counted_and_is_the_last_selection(byte_tokenizer):
    # One state slot in all: the next turn cannot copy its checkpoint's state, it takes the slot over.
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=0)
    first = _conversation("a")
    h.add(req("a1", first, max_new=3))
    h.run()
    h.cache.counters.take(len(h.cache))
    h.add(req("a2", _next_turn(h, "a1", first), max_new=3))
    h.run()
    record = h.cache.counters.take(len(h.cache))
    assert record["adoptions"] == 1 and record["selection"]["hits"] == {"private_endpoint": 1}
    selection = record["last_selection"]
    assert selection["target"] == "adopted_checkpoint" and selection["reuse_path"] == "private_endpoint"
    assert selection["reused_tokens"] == h.final("a2").cached_tokens > 0


def test_take_starts_a_new_interval_but_keeps_the_last_selection_gauge():
    counters = CacheCounters()
    counters.misses = 2
    counters.pressure_searches = 1
    counters.degrade(shared=False, kind="kv_spills")
    counters.last_selection = {"target": "root"}
    assert counters.has_activity
    first = counters.take(occupancy=3)
    assert first["selection"]["misses"] == 2 and first["pressure"]["degradation"]["private"]["kv_spills"] == 1
    assert not counters.has_activity
    second = counters.take(occupancy=3)
    assert second["selection"]["misses"] == 0 and second["pressure"]["searches"] == 0
    assert second["last_selection"] == {"target": "root"}
