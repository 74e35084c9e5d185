"""ContinuationForecast: predicted turns of conversations and the identity of dropped ones."""

import math

from ninfer.engine.cache import continuation_forecast
from ninfer.engine.cache.continuation_forecast import ContinuationForecast


def test_a_conversation_that_has_not_come_back_yet_takes_the_typical_interval():
    forecast = ContinuationForecast()
    forecast.note_turn("a")
    assert forecast.next_turn("a", current=True) == 2  # a newcomer: due at the next admission
    for name in "bcbc":  # b and c come back every 2 admissions
        forecast.note_turn(name)
    forecast.note_turn("d")  # tick 6
    assert forecast.typical_interval() == 2
    assert forecast.next_turn("d", current=True) == 7
    assert forecast.next_turn("d") == 8  # seen from a later admission: the typical interval
    # a was due at tick 3 and has not come: ordered by its age, as least recently used would.
    assert forecast.next_turn("a") == 6 + 5
    assert forecast.next_turn("forgotten") == math.inf and forecast.last_turn("forgotten") == 0


def test_the_next_turn_follows_the_mean_interval_and_ages_once_overdue():
    forecast = ContinuationForecast()
    for name in "abcabc":  # round-robin: each conversation comes back every 3 admissions
        forecast.note_turn(name)
    assert [forecast.next_turn(name) for name in "abc"] == [7, 8, 9]
    forecast.note_turn("a")  # tick 7: a on time
    forecast.note_turn("a")  # tick 8: a again after 1, mean (3 + 1) / 2
    assert forecast.next_turn("a") == 10
    for _ in range(10):
        forecast.note_turn("z")
    forecast.note_turn("a")  # tick 19, after a pause of 11: interval (2 + 11) / 2
    assert forecast.next_turn("a") == 19 + 6.5
    assert forecast.next_turn("a", current=True) == 19 + forecast.typical_interval() < 19 + 6.5
    for _ in range(9):  # back to tick 28 for what follows
        forecast.note_turn("x")
    # b was due at tick 8 and has not come since tick 5: ordered by its age (tick 28).
    assert forecast.tick == 28 and forecast.next_turn("b") == 28 + 23


def test_recall_finds_the_longest_remembered_prefix_a_prompt_extends():
    forecast = ContinuationForecast()
    history = list(range(1000, 1300))
    forecast.remember("short", history[:100])
    forecast.remember("long", history[:250])
    assert forecast.recall(history + [7]) == "long"
    assert forecast.recall(history[:200]) == "short"
    assert forecast.recall(history[:99]) is None
    edited = list(history)
    edited[10] = 5  # a different prefix with the same tail
    assert forecast.recall(edited) is None
    forecast.remember("long", history[:50])  # a conversation keeps several prefixes
    assert forecast.recall(history[:60]) == "long" and forecast.recall(history) == "long"
    for length in (260, 270, 280, 290):  # ... its longest few
        forecast.remember("long", history[:length])
    assert forecast.recall(history[:60]) is None and forecast.recall(history[:265]) == "long"


def test_ghosts_are_bounded():
    forecast = ContinuationForecast()
    for index in range(continuation_forecast.MAX_GHOSTS + 5):
        forecast.remember(f"c{index}", [index] * 8)
    assert forecast.recall([0] * 9) is None  # the oldest were forgotten
    last = continuation_forecast.MAX_GHOSTS + 4
    assert forecast.recall([last] * 9) == f"c{last}"


def test_turns_until_counts_whole_admissions_and_orders_an_overdue_key_after_one_just_used():
    forecast = ContinuationForecast()
    for name in "bba":  # b comes back at once; a is a newcomer at tick 3
        forecast.note_turn(name)
    assert forecast.turns_until("a", current=True) == 1
    # b was due at tick 3 and has not come: as least recently used would order it, after the
    # newcomer just used (next_turn ties them at tick 4).
    assert forecast.next_turn("b") == forecast.next_turn("a", current=True) == 4
    assert forecast.turns_until("b") == 2
    for name in "cxcc":  # c's interval (2 + 1) / 2 = 1.5, due at tick 8.5: the second admission from tick 7
        forecast.note_turn(name)
    assert forecast.turns_until("c", current=True) == forecast.turns_until("c") == 2
    assert forecast.turns_until("forgotten") == math.inf
