"""EngineLoop's idle turns: idle-turn work (step graph captures) waits until the engine has been
idle for its grace, so a client's next request does not wait behind a capture; work deferred
too long runs at the next idle turn anyway. A stand-in core and a scripted clock: the loop's
policy alone."""

from __future__ import annotations

from ninfer.contract.messages import AddRequest, Shutdown
from ninfer.engine import loop as loop_module
from ninfer.engine.loop import EngineLoop


class _Core:
    """What EngineLoop calls on an EngineCore: each request is one step; jobs are idle-turn work."""

    def __init__(self, clock, jobs: int):
        self.clock = clock
        self.jobs = jobs
        self.steps_left = 0
        self.events: list[tuple[str, float]] = []
        self.failed = None

    has_work = property(lambda self: self.steps_left > 0)
    has_background_work = property(lambda self: self.jobs > 0)

    def background_step(self):
        assert not self.has_work
        self.jobs -= 1
        self.events.append(("capture", self.clock.now))

    def add_request(self, request):
        self.steps_left += 1
        self.events.append(("request", self.clock.now))
        return []

    def step(self):
        self.steps_left -= 1
        return []

    def seconds_to_stats_boundary(self):
        return None

    seconds_to_rank_check = None

    def log_stats_if_due(self):
        pass

    def check_ranks(self):
        return []

    def take_stats_records(self):
        return []

    def take_idle_gauges(self):
        return None

    def close(self):
        pass


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(arrivals: list[float], jobs: int, end: float, grace: float = 2.0):
    """Requests arrive at the times given; the inbox's timeouts pass on the scripted clock."""
    clock = _Clock()
    core = _Core(clock, jobs)
    pending = sorted(arrivals)
    waits = []

    def receive(timeout):
        waits.append(timeout)
        if pending and (timeout is None or pending[0] <= clock.now + timeout):
            clock.now = max(clock.now, pending.pop(0))
            return AddRequest(request=None)
        if timeout is None or clock.now + timeout >= end:
            return Shutdown()
        clock.now += timeout
        return None

    EngineLoop(core, receive, lambda message: None, idle_grace_s=grace, clock=clock).run()
    return core.events, waits


def test_idle_turn_work_waits_for_the_grace_after_the_last_request():
    events, waits = _run(arrivals=[0.5, 1.8], jobs=3, end=60.0)
    # Ready at 0: nothing captured before the first request (0.5) nor within 2 s of the second (1.8).
    assert events[:2] == [("request", 0.5), ("request", 1.8)]
    assert events[2:] == [("capture", 3.8)] * 3  # then one per idle turn, back to back
    assert waits[0] == 2.0  # idle at ready: the inbox waits out the grace, not forever


def test_without_a_grace_the_engine_captures_at_once():
    events, _ = _run(arrivals=[0.5], jobs=2, end=60.0, grace=0.0)
    assert events == [("capture", 0.0), ("capture", 0.0), ("request", 0.5)]


def test_work_deferred_too_long_runs_at_the_next_idle_turn():
    arrivals = [1.5 * i for i in range(1, 40)]  # a request every 1.5 s: never 2 s idle
    events, _ = _run(arrivals=arrivals, jobs=2, end=60.0)
    captures = [at for event, at in events if event == "capture"]
    assert len(captures) == 2
    # Both in the idle turns right after 30 s pending, whatever the grace.
    assert loop_module.MAX_DEFER_S <= captures[0] <= captures[1] < loop_module.MAX_DEFER_S + 3.0
    assert all(at == 1.5 * i for i, (event, at) in enumerate((e for e in events if e[0] == "request"), 1))
