"""RequestTiming: each request's share of the host and device time of the steps it was in.

Every request in a step waited for the whole step, so each is charged all of the step's host
time in a phase (a HostExposure field) and its device wait; decode rows add to the request's
decode figures, prompt chunks count its prefill units. A final output carries the totals
(EngineTiming).
"""

from __future__ import annotations

from ninfer.engine.scheduler.active_requests import ActiveRequests
from ninfer.engine.scheduler.step import SchedulerStep


class RequestTiming:
    def __init__(self, active: ActiveRequests):
        self.active = active

    def charge(self, step: SchedulerStep, phase: str, seconds: float, device_wait: float = 0.0) -> None:
        """Add a step's host time in `phase` and its device wait to every request in it."""
        by_id = self.active.by_id()
        for chunk in step.chunks:
            seq = by_id.get(chunk.request_id)
            if seq is None:
                continue
            timing = seq.engine_timing
            host = timing.host_exposed_seconds
            setattr(host, phase, getattr(host, phase) + seconds)
            timing.device_wait_exposed_seconds += device_wait
            if seq.is_prefilling or not chunk.token_ids:
                if phase == "program_submit":
                    timing.units.prefill += 1
            else:
                timing.decode.host_exposed_seconds += seconds
                timing.decode.device_wait_seconds += device_wait
                if phase == "program_submit":
                    timing.decode.rounds += 1

    def charge_vision(self, seconds_by_request: dict[str, float]) -> None:
        """Add vision tower time to the requests whose media it encoded."""
        by_id = self.active.by_id()
        for request_id, seconds in seconds_by_request.items():
            seq = by_id.get(request_id)
            if seq is not None:
                seq.timings.vision_seconds += seconds
