"""HostTime: where the engine worker's wall time went over one throughput interval, each
segment counted once.

Host-active time splits into five mutually exclusive phases (EngineTiming's names):
engine_boundary (applying requests and aborts), program_submit (planning and launching steps),
program_post (reading results back; folded into device wait today, as the read is a wait on
the device), engine_commit_output (committing tokens, building outputs) and engine_maintenance
(throughput records). Device wait (the host blocked on the device) is kept apart. Each segment
is also counted under the class of the step it served: decode, prefill (steps with prompt
tokens) or control.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("engine_boundary", "program_submit", "program_post", "engine_commit_output", "engine_maintenance")
CLASSES = ("decode", "prefill", "control")


@dataclass
class HostTime:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys((*PHASES, "device_wait"), 0.0))
    class_seconds: dict[str, dict[str, float]] = field(
        default_factory=lambda: {c: {"host": 0.0, "device_wait": 0.0} for c in CLASSES}
    )

    def add(self, work_class: str, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds
        self.class_seconds[work_class]["device_wait" if phase == "device_wait" else "host"] += seconds

    @property
    def host_total(self) -> float:
        return sum(self.seconds[p] for p in PHASES)

    def to_record(self, decode_rounds: int, decode_row_rounds: int) -> dict:
        """throughput.host_work; per-round values are null when nothing decoded."""
        decode_host = self.class_seconds["decode"]["host"]
        return {
            "elapsed_seconds": {**{p: self.seconds[p] for p in PHASES}, "total": self.host_total},
            "device_wait_seconds": self.seconds["device_wait"],
            "work_class_seconds": {c: dict(v) for c, v in self.class_seconds.items()},
            "decode_host_seconds_per_round": decode_host / decode_rounds if decode_rounds else None,
            "decode_host_seconds_per_row_round": decode_host / decode_row_rounds if decode_row_rounds else None,
        }
