"""ContinuationForecast: when each conversation is likely to send its next turn.

An input to the cache planner's drop order (planner.py): the checkpoints needed last go first.
Ordered by recompute and recency alone, the planner fails exactly when agents interleave more
conversations than the cache keeps (--max-private-continuations, 2 at C = 1): round-robin, the
least recently used conversation is the one due next, and every turn recomputes its whole
prompt. The forecast predicts each conversation's next turn (Belady's rule, predicted): its
last turn plus its interval between turns (a running average that weighs the newest gap half,
counted in admissions). A newcomer is due at the next admission (as least recently used would
have it: a conversation's second turn usually follows soon); after that, until it comes back,
it is assumed to take the median interval of those that have, and the conversation being
captured is assumed no slower than that median (one back after a long pause goes on at the
usual pace). One past its predicted turn is off its schedule and is ordered as least recently
used would, by its age, so abandoned conversations and one-off requests give way. A shared
prefix is forecast the same way, a use being any admitted prompt that extends it.

A conversation whose checkpoints were dropped keeps its identity as a ghost (the digests
of its longest dropped or declined prefixes): its next turn, a miss, is still recognised
and measures an interval. Ghosts only name conversations; they never change what is
computed.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass

MAX_TRACKED_CONTINUATIONS = 1024  # bounded memory: older conversations are forgotten
MAX_GHOSTS = 64  # conversations remembered; each miss compares its prompt with their prefixes
GHOSTS_PER_CONVERSATION = 4  # the longest dropped or declined prefixes of each
GHOST_TAIL_TOKENS = 64  # compared before a ghost's digest is (re)computed


def prefix_digest(token_ids: list[int]) -> bytes:
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).digest()


@dataclass
class _Turns:
    last_tick: int
    interval: float | None = None  # running average; None until the conversation comes back once


@dataclass(frozen=True)
class _Ghost:
    frontier: int
    tail: tuple[int, ...]
    digest: bytes


class ContinuationForecast:
    def __init__(self) -> None:
        self.tick = 0  # admissions so far
        self._turns: OrderedDict[str, _Turns] = OrderedDict()
        self._ghosts: OrderedDict[str, list[_Ghost]] = OrderedDict()
        self._typical: float | None = None  # typical_interval(), until the next turn

    def __len__(self) -> int:
        """Conversations and shared prefixes it tracks."""
        return len(self._turns)

    def note_turn(self, continuation: str) -> None:
        """A request of this conversation was admitted."""
        self.tick += 1
        self.note_use(continuation)

    def note_use(self, key: str) -> None:
        """The admission just noted also used `key` (a conversation, or a shared prefix its prompt extends)."""
        self._typical = None
        turns = self._turns.pop(key, None)
        if turns is None:
            turns = _Turns(self.tick)
        elif self.tick > turns.last_tick:  # not the same admission again
            gap = self.tick - turns.last_tick
            # Even weight to the newest gap: agents' pace changes between phases of a task.
            turns.interval = gap if turns.interval is None else (turns.interval + gap) / 2
            turns.last_tick = self.tick
        self._turns[key] = turns
        while len(self._turns) > MAX_TRACKED_CONTINUATIONS:
            self._turns.popitem(last=False)

    def next_turn(self, continuation: str, current: bool = False) -> float:
        """Predicted admission tick of its next turn. `current`: the conversation being captured
        now; any other one that was due by now is overdue."""
        turns = self._turns.get(continuation)
        if turns is None:
            return math.inf  # forgotten: not seen for over MAX_TRACKED_CONTINUATIONS conversations
        due = self._scheduled(turns, current)
        if current or due > self.tick:
            return due
        # Overdue (this admission is not its turn): off its schedule, so ordered as least recently
        # used would, as far ahead as it is old. Abandoned conversations and one-offs age out.
        return self.tick + (self.tick - turns.last_tick)

    def turns_until(self, key: str, current: bool = False) -> int | float:
        """Whole admissions from now until its next turn, at least 1 (the next admission is the
        soonest it can come). One overdue comes after as many admissions as it has been away,
        plus one: least recently used would order it after a key just used (a newcomer, due at
        the next admission), where next_turn leaves them tied."""
        turns = self._turns.get(key)
        if turns is None:
            return math.inf  # forgotten, as in next_turn
        due = self._scheduled(turns, current)
        if current or due > self.tick:
            return max(1, math.ceil(due - self.tick))
        return self.tick - turns.last_tick + 1

    def _scheduled(self, turns: _Turns, current: bool) -> float:
        """The admission tick its turns' pace predicts."""
        if current:
            if turns.interval is None:
                return self.tick + 1  # a newcomer is kept, as least recently used would: most are agents' turns
            # Back after a long pause, a conversation's next turns still come at the usual pace.
            return turns.last_tick + min(turns.interval, self.typical_interval())
        return turns.last_tick + (turns.interval if turns.interval is not None else self.typical_interval())

    def typical_interval(self) -> float:
        """What a conversation that has not come back yet is assumed to take: the median interval
        of those that have (1 while none has: due at the next admission)."""
        if self._typical is None:
            intervals = sorted(t.interval for t in self._turns.values() if t.interval is not None)
            self._typical = intervals[len(intervals) // 2] if intervals else 1.0
        return self._typical

    def last_turn(self, continuation: str) -> int:
        turns = self._turns.get(continuation)
        return turns.last_tick if turns is not None else 0

    def remember(self, continuation: str, token_ids: list[int]) -> None:
        """Keep the identity of a conversation that loses (or is declined) a checkpoint at
        len(token_ids). A few prefixes each: a next turn extends its turn closure, not the reply's end."""
        ghosts = self._ghosts.pop(continuation, [])
        if all(g.frontier != len(token_ids) for g in ghosts):
            ghosts.append(_Ghost(len(token_ids), tuple(token_ids[-GHOST_TAIL_TOKENS:]), prefix_digest(token_ids)))
            ghosts = sorted(ghosts, key=lambda g: g.frontier)[-GHOSTS_PER_CONVERSATION:]
        self._ghosts[continuation] = ghosts
        while len(self._ghosts) > MAX_GHOSTS:
            self._ghosts.popitem(last=False)

    def recall(self, prompt: list[int]) -> str | None:
        """The conversation whose longest remembered prefix this prompt extends, if any."""
        best: tuple[int, str] | None = None
        for continuation, ghosts in self._ghosts.items():
            for ghost in ghosts:
                frontier = ghost.frontier
                if frontier > len(prompt) or (best is not None and frontier <= best[0]):
                    continue
                if tuple(prompt[frontier - len(ghost.tail) : frontier]) != ghost.tail:
                    continue
                if prefix_digest(prompt[:frontier]) == ghost.digest:
                    best = (frontier, continuation)
        return best[1] if best is not None else None
