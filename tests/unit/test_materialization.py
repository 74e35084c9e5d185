"""The admission decision each request's final output reports (request_done.materialization):
its target, the predicted costs in the planner's own units, and what it took from the cache."""

from __future__ import annotations

from ninfer.engine.cache.context_costs import generic_costs
from tests.unit.test_scheduler import PROMPT, Harness, _conversation, _next_turn, req

COSTS = generic_costs("cpu")  # what the harness's planner weighs


def ns(seconds: float) -> int:
    return round(seconds * 1e9)


def test_a_fresh_request_plans_from_root_without_pressure(byte_tokenizer):
    h = Harness(byte_tokenizer)
    h.add(req("a", PROMPT, max_new=2))
    h.run()
    m = h.final("a").materialization
    assert m.target == "root" and m.reused_tokens == 0 and not m.maximal_root_fallback
    assert m.predicted_immediate_ns == ns(COSTS.recompute_seconds(len(PROMPT)))
    assert m.predicted_future_loss_ns == 0 and m.predicted_total_ns == m.predicted_immediate_ns
    assert (m.evaluated_targets, m.projection_work, m.stop_reason, m.budget_exhausted) == (1, 0, "no_pressure", False)
    assert (m.degradation_units.dropped, m.degradation_units.kv_spilled, m.degradation_units.state_spilled) == (0, 0, 0)
    assert m.planning_ns > 0


def test_a_resumed_request_predicts_only_the_tokens_past_its_checkpoint(byte_tokenizer):
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=3)
    first = _conversation("a")
    h.add(req("a1", first, max_new=3))
    h.run()
    follow = _next_turn(h, "a1", first)
    h.add(req("a2", follow, max_new=3))
    h.run()
    out = h.final("a2")
    m = out.materialization
    assert m.target in ("checkpoint", "adopted_checkpoint") and m.reused_tokens == out.cached_tokens > 0
    assert m.predicted_immediate_ns == ns(COSTS.recompute_seconds(len(follow) - out.cached_tokens))


def test_kv_pressure_reports_what_the_plan_gave_up_and_why_the_search_stopped(byte_tokenizer):
    # A KV pool for about one conversation: the second conversation's admission pushes the first's
    # checkpoints out; with a host KV tier their pages go there.
    page_bytes = 4096
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=3, kv_tokens=96, page_size=8, host_kv_pages=24,
                planner_rates=(COSTS, 1 << 20, page_bytes))
    h.add(req("a1", _conversation("first") + PROMPT[:8], max_new=3))
    h.run()
    before = {ck.checkpoint_id for ck in h.cache.checkpoints.values() if not ck.kv_on_host}
    h.add(req("b1", _conversation("other"), max_new=3))
    h.run()
    m = h.final("b1").materialization
    units = m.degradation_units
    spilled = {ck.checkpoint_id for ck in h.cache.checkpoints.values() if ck.kv_on_host}
    assert units.kv_spilled == len(spilled & before) > 0
    assert m.stop_reason in ("value_of_next_expansion", "queue_exhausted") and m.projection_work >= 1
    restore = sum(COSTS.transfer_seconds(len(ck.host_pages) * page_bytes)
                  for ck in h.cache.checkpoints.values() if ck.checkpoint_id in spilled & before)
    assert abs(m.predicted_future_loss_ns - ns(restore)) <= 1 and restore > 0  # restoring those pages later
    assert m.predicted_total_ns == m.predicted_immediate_ns + m.predicted_future_loss_ns


def test_without_a_host_tier_kv_pressure_drops_and_counts_them(byte_tokenizer):
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=3, kv_tokens=96, page_size=8)
    h.add(req("a1", _conversation("first") + PROMPT[:8], max_new=3))
    h.run()
    held = len(h.cache)
    h.add(req("b1", _conversation("other"), max_new=3))
    h.run()
    m = h.final("b1").materialization
    assert m.degradation_units.kv_spilled == 0 and 0 < m.degradation_units.dropped <= held
    assert m.predicted_future_loss_ns > 0  # the recompute those checkpoints saved


def test_a_device_slot_freed_for_the_request_counts_as_a_state_spill(byte_tokenizer):
    # One lane and one checkpoint slot: the second conversation's slot comes from the first's
    # checkpoint, whose StateImage goes to the host tier (restoring it later is its loss).
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=1, host_slots=2, planner_rates=(COSTS, 1 << 20, 0))
    h.add(req("a1", _conversation("first"), max_new=3))
    h.run()
    spills = h.scheduler.placement.num_spills
    h.add(req("b1", _conversation("other"), max_new=3))
    h.run()
    m = h.final("b1").materialization
    spilled_at_admission = m.degradation_units.state_spilled
    assert spilled_at_admission >= 1 and h.scheduler.placement.num_spills - spills >= spilled_at_admission
    assert m.predicted_future_loss_ns >= ns(COSTS.transfer_seconds(1 << 20)) * spilled_at_admission
