"""DraftPolicy: a request drafts while its acceptance pays for the round, decodes plainly
otherwise, and probes again after plain rounds whose number doubles after each failed probe."""

from __future__ import annotations

import pytest

from ninfer.engine.speculative.draft_policy import (
    FIRST_PROBE_INTERVAL,
    MAX_PROBE_INTERVAL,
    DraftPolicy,
    expected_tokens,
)
from ninfer.engine.speculative.round_costs import RoundCosts

round_cost_ratio = RoundCosts().ratio

CONTEXT = 4096


def test_expected_tokens_is_the_accepted_prefix_plus_one() -> None:
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_round_cost_grows_with_drafts_and_context() -> None:
    assert 1.0 < round_cost_ratio(1, CONTEXT) < round_cost_ratio(3, CONTEXT) < round_cost_ratio(5, CONTEXT)
    assert round_cost_ratio(3, 131072) > round_cost_ratio(3, CONTEXT)


def test_rejected_drafts_switch_drafting_off_within_a_few_rounds() -> None:
    policy = DraftPolicy(3)
    assert policy.wants_drafts()
    rounds = 0
    while policy.drafting:
        policy.observe(3, 0, CONTEXT)
        rounds += 1
    assert rounds <= 3
    assert not policy.wants_drafts()


def test_probes_come_back_at_doubling_intervals_while_they_fail() -> None:
    policy = DraftPolicy(3)
    while policy.drafting:
        policy.observe(3, 0, CONTEXT)
    intervals = []
    for _ in range(6):
        plain = 0
        while not policy.wants_drafts():
            policy.plain_round()
            plain += 1
        intervals.append(plain)
        policy.observe(0, 0, CONTEXT)  # the probe's first round only refills the drafts
        assert policy.wants_drafts()
        policy.observe(3, 0, CONTEXT)  # ...the second one verifies them: rejected
    assert intervals[0] == FIRST_PROBE_INTERVAL
    assert intervals[1:4] == [2 * FIRST_PROBE_INTERVAL, 4 * FIRST_PROBE_INTERVAL, 8 * FIRST_PROBE_INTERVAL]
    assert max(intervals) == MAX_PROBE_INTERVAL


def test_a_successful_probe_resumes_drafting() -> None:
    policy = DraftPolicy(3)
    while policy.drafting:
        policy.observe(3, 0, CONTEXT)
    for _ in range(FIRST_PROBE_INTERVAL):
        policy.plain_round()
    for _ in range(3):  # code after prose: the drafts are accepted again
        policy.observe(3, 3, CONTEXT)
        if policy.drafting:
            break
    assert policy.drafting and policy.probe_interval == FIRST_PROBE_INTERVAL


def test_good_acceptance_keeps_drafting_and_long_contexts_ask_for_more() -> None:
    policy = DraftPolicy(3)
    for _ in range(50):
        policy.observe(3, 2, CONTEXT)  # about 2/3 of the drafts accepted
    assert policy.drafting
    # The same acceptance over a context where the verification rows' attention dominates.
    assert not policy.worth_drafting(10_000_000)


def test_the_cost_follows_the_measured_points_between_and_past_them() -> None:
    assert round_cost_ratio(3, 4096) == pytest.approx(1.367)
    assert round_cost_ratio(3, 2048) == pytest.approx(1.367)  # below the first context: as measured there
    assert round_cost_ratio(4, 4096) == pytest.approx((1.367 + 1.478) / 2)
    assert round_cost_ratio(15, 4096) > round_cost_ratio(7, 4096)  # DFlash windows: extended
    midway = (4096 + 131072) // 2
    assert round_cost_ratio(3, 4096) < round_cost_ratio(3, midway) < round_cost_ratio(3, 131072)


def test_a_calibrated_table_passes_through_the_engines_own_timing() -> None:
    """An engine that timed its batch-1 round at 1.22 plain rounds: the table keeps its growth
    with drafts and context but starts there, and the policy weighs rounds by it."""
    costs = RoundCosts.calibrated(3, 1.22)
    assert costs.ratio(3, 4096) == pytest.approx(1.22)
    assert costs.ratio(3, 131072) - costs.ratio(3, 4096) == pytest.approx(round_cost_ratio(3, 131072) - 1.367)
    assert costs.ratio(1, 4096) < costs.ratio(3, 4096) < costs.ratio(5, 4096)
    assert RoundCosts.calibrated(1, 0.7).ratio(1, 4096) == 1.0  # never cheaper than a plain round
    # Acceptance 0.2 yields 1.248 tokens a round: with the 5% margin that pays for a round of 1.15
    # plain rounds, not one of 1.22 nor the table's 1.367.
    policies = [DraftPolicy(3, costs=costs) for costs in (RoundCosts.calibrated(3, 1.15),
                                                          RoundCosts.calibrated(3, 1.22), RoundCosts())]
    for policy in policies:
        policy.accepted, policy.drafted = 0.2, 1.0
    assert [policy.worth_drafting(CONTEXT) for policy in policies] == [True, False, False]
