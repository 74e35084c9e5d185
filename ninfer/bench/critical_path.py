"""Critical-path increments of a kernel timeline: what each kernel adds to a serial chain.

In a chain of dependent kernels launched with programmatic dependent launch, a kernel's own
duration counts the time its programs wait for the previous one, so summing durations
double-counts. What a kernel adds is how far it moves the chain's end: end_i - the latest
end before it (0 when it ends inside an earlier kernel). Summed per kernel name, the
increments add up to the profiled span minus the idle gaps before the first kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class KernelIncrement:
    name: str
    calls: int
    increment_us: float  # summed over calls
    duration_us: float  # summed over calls, waiting included


def critical_path_increments(events: list[dict[str, Any]]) -> list[KernelIncrement]:
    """events: chrome-trace kernel events ({"name", "ts", "dur"} in µs) -> per name, largest first."""
    kernels = sorted((e for e in events if e.get("dur") is not None), key=lambda e: e["ts"])
    by_name: dict[str, KernelIncrement] = {}
    chain_end = kernels[0]["ts"] if kernels else 0.0
    for event in kernels:
        end = event["ts"] + event["dur"]
        entry = by_name.setdefault(event["name"], KernelIncrement(event["name"], 0, 0.0, 0.0))
        entry.calls += 1
        entry.increment_us += max(0.0, end - chain_end)
        entry.duration_us += event["dur"]
        chain_end = max(chain_end, end)
    return sorted(by_name.values(), key=lambda k: -k.increment_us)


def increments_table(events: list[dict[str, Any]], repeats: int, name_width: int = 90) -> str:
    """Text table per repeat (µs per run): increment, duration, calls, name."""
    rows = critical_path_increments(events)
    total = sum(r.increment_us for r in rows) / max(1, repeats)
    lines = [f"critical-path increments per run ({repeats} runs): {total:,.1f} us in all", ""]
    lines.append(f"{'increment us':>13} {'duration us':>12} {'calls':>6}  kernel")
    for r in rows:
        lines.append(
            f"{r.increment_us / repeats:13.1f} {r.duration_us / repeats:12.1f} {r.calls / repeats:6.0f}  {r.name[:name_width]}"
        )
    return "\n".join(lines) + "\n"
