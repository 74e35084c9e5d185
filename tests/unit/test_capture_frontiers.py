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


def frontiers(hints: list[tuple[int, ReusePath]], reused: int = 0, prompt_len: int = 10_000):
    return capture_frontiers([CaptureHint(f, p) for f, p in hints], reused, prompt_len, ENDPOINT)


def test_a_turn_closure_just_after_a_shared_prefix_is_left_to_it():
    # Chat: the implicit cache candidate ends the last message's text, the closure follows its end marker.
    assert frontiers([(9_993, SHARED), (9_995, CLOSURE)]) == [(9_993, SHARED), (10_000, ENDPOINT)]
    far = 9_995 - CLOSURE_MIN_GAP - 1  # a short last message after a breakpoint: both are worth a step
    assert frontiers([(far, SHARED), (9_995, CLOSURE)]) == [(far, SHARED), (9_995, CLOSURE), (10_000, ENDPOINT)]
    # Messages: no implicit candidate, the closure stays whatever precedes it.
    assert frontiers([(9_995, CLOSURE)], reused=9_990) == [(9_995, CLOSURE), (10_000, ENDPOINT)]


def test_shared_prefixes_are_always_captured():
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


def test_a_resumed_chat_turn_takes_two_prompt_steps_instead_of_four(byte_tokenizer):
    """The shape seen on an agent's Chat turn: resumed at the previous turn's implicit candidate, a
    long anchor a few tokens on (the assistant message's start), the new implicit candidate and the
    turn closure two tokens apart, then the generation prompt."""
    h = Harness(byte_tokenizer, max_concurrency=1, extra_slots=4, kv_tokens=4096, max_context=2048, prefill_chunk=2048)
    sampling = SamplingParams(temperature=0.0)
    history = [97 + i % 26 for i in range(600)]
    h.add(EngineRequest("t1", history, sampling, max_new_tokens=2, capture_hints=[CaptureHint(593, SHARED)]))
    h.run()
    # The next prompt renders the closed turn differently after its text (no generation prompt).
    turn = history[:596] + [65 + i % 26 for i in range(900)]
    hints = [CaptureHint(599, ANCHOR), CaptureHint(1_489, SHARED), CaptureHint(1_491, CLOSURE)]
    h.steps.clear()
    h.add(EngineRequest("t2", turn, sampling, max_new_tokens=2, capture_hints=hints))
    h.run()
    prompt_steps = [[(c.num_computed_tokens, len(c.token_ids)) for c in s.chunks] for s in h.steps
                    if s.kind is StepKind.PREFILL]
    assert prompt_steps == [[(593, 896)], [(1_489, 7)]]
    assert h.final("t2").cached_tokens == 593
    checkpoints = sorted((ck.frontier, ck.path) for ck in h.cache.checkpoints.values())
    assert (1_489, SHARED) in checkpoints and all(f not in (599, 1_491) for f, _ in checkpoints)
    h.assert_balanced()
