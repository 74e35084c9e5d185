"""Where a prompt leaves checkpoints: frontiers a few tokens apart are coalesced, since each one
inside the prompt ends a prompt step there."""

from __future__ import annotations

from ninfer.contract.request import CaptureHint, EngineRequest
from ninfer.contract.reuse_path import ReusePath
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.scheduler import StepKind
from ninfer.engine.scheduler.checkpoints import ANCHOR_MIN_GAP, CLOSURE_MIN_GAP, capture_frontiers
from tests.unit.test_scheduler import Harness

SHARED, CLOSURE, ANCHOR = ReusePath.SHARED_STABLE_PREFIX, ReusePath.PRIVATE_TURN_CLOSURE, ReusePath.PRIVATE_LONG_ANCHOR
ENDPOINT = ReusePath.PRIVATE_ENDPOINT


def frontiers(hints: list[tuple], reused: int = 0, prompt_len: int = 10_000):
    """hints: (frontier, path) or (frontier, path, implicit)."""
    return capture_frontiers([CaptureHint(*h) for h in hints], reused, prompt_len, ENDPOINT)


def test_the_implicit_cache_candidate_just_before_a_turn_closure_is_left_to_it():
    # Chat: the implicit candidate ends the last message's text, the closure follows its end marker.
    assert frontiers([(9_993, SHARED, True), (9_995, CLOSURE)]) == [(9_995, CLOSURE), (10_000, ENDPOINT)]
    far = 9_995 - CLOSURE_MIN_GAP - 1  # the candidate further back (not what templates produce): both stay
    assert frontiers([(far, SHARED, True), (9_995, CLOSURE)]) == [(far, SHARED), (9_995, CLOSURE), (10_000, ENDPOINT)]
    # Without a closure after it (a continued final message), the candidate is the frontier.
    assert frontiers([(9_993, SHARED, True)]) == [(9_993, SHARED), (10_000, ENDPOINT)]


def test_breakpoints_a_client_asked_for_and_turn_closures_are_always_captured():
    # Anthropic cache_control on the last message: its own checkpoint, beside the closure.
    assert frontiers([(9_993, SHARED), (9_995, CLOSURE)]) == [(9_993, SHARED), (9_995, CLOSURE), (10_000, ENDPOINT)]
    hints = [(5_000, SHARED), (5_002, SHARED), (5_010, ANCHOR)]
    assert frontiers(hints, reused=4_999) == [(5_000, SHARED), (5_002, SHARED), (10_000, ENDPOINT)]


def test_long_anchors_close_to_the_reuse_point_or_another_frontier_are_left_out():
    assert frontiers([(4_006, ANCHOR)], reused=4_000) == [(10_000, ENDPOINT)]
    assert frontiers([(4_000 + ANCHOR_MIN_GAP + 1, ANCHOR)], reused=4_000) == [
        (4_000 + ANCHOR_MIN_GAP + 1, ANCHOR), (10_000, ENDPOINT)]
    assert frontiers([(9_900, ANCHOR), (9_995, CLOSURE)]) == [(9_995, CLOSURE), (10_000, ENDPOINT)]
    assert frontiers([(9_900, ANCHOR)]) == [(10_000, ENDPOINT)]  # the prompt end is a frontier too
    assert frontiers([(3_000, ANCHOR), (6_000, ANCHOR), (9_995, CLOSURE)]) == [
        (3_000, ANCHOR), (6_000, ANCHOR), (9_995, CLOSURE), (10_000, ENDPOINT)]


def test_frontiers_at_or_before_the_reuse_point_are_not_captured_again():
    assert frontiers([(2_000, SHARED), (3_000, CLOSURE)], reused=3_000) == [(10_000, ENDPOINT)]
    assert frontiers([], reused=0, prompt_len=10) == [(10, ENDPOINT)]


def test_a_resumed_chat_turn_takes_one_prompt_step_instead_of_four(byte_tokenizer):
    """The shape seen on an agent's Chat turn: resumed at the previous turn's closure, a long anchor
    a few tokens on (the assistant message's start), the new implicit candidate and turn closure
    two tokens apart, then the generation prompt. Coalescing leaves one capture, the turn
    closure, and the step snapshots it on its way to the generation prompt."""
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=4, kv_tokens=4096, max_context=2048, prefill_chunk=2048)
    sampling = SamplingParams(temperature=0.0)
    history = [97 + i % 26 for i in range(600)]
    h.add(EngineRequest("t1", history, sampling, max_new_tokens=2,
                        capture_hints=[CaptureHint(593, SHARED, implicit=True), CaptureHint(595, CLOSURE)]))
    h.run()
    # The next prompt renders the closed turn differently after its text (no generation prompt).
    turn = history[:597] + [65 + i % 26 for i in range(899)]
    hints = [CaptureHint(601, ANCHOR), CaptureHint(1_489, SHARED, implicit=True), CaptureHint(1_491, CLOSURE)]
    h.steps.clear()
    captured = dict(h.cache.counters.captures)
    h.add(EngineRequest("t2", turn, sampling, max_new_tokens=2, capture_hints=hints))
    h.run()
    prompt_steps = [[(c.num_computed_tokens, len(c.token_ids), c.snapshot_tokens) for c in s.chunks]
                    for s in h.steps if s.kind is StepKind.PREFILL]
    assert prompt_steps == [[(595, 901, 896)]]  # the closure at 1,491, inside the step
    assert h.final("t2").cached_tokens == 595 and h.final("t2").reuse_path == CLOSURE
    new_captures = {path: n - captured.get(path, 0) for path, n in h.cache.counters.captures.items()}
    assert new_captures.get(CLOSURE.value) == 1  # at 1,491; the candidate and the anchor never were
    assert not new_captures.get(SHARED.value) and not new_captures.get(ANCHOR.value)
    h.assert_balanced()
