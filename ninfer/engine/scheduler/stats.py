"""SchedulerStats: the scheduler's token and round counters over one throughput interval."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    """Counters since the last throughput record (the engine reads and resets them)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0  # committed by decode rows (with speculation: accepted, never drafted)
    decode_rounds: int = 0
    decode_rows: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    def reset(self) -> SchedulerStats:
        snapshot = SchedulerStats(self.prefill_tokens, self.decode_tokens, self.decode_rounds, self.decode_rows,
                                  self.drafted_tokens, self.accepted_tokens)
        self.prefill_tokens = self.decode_tokens = self.decode_rounds = self.decode_rows = 0
        self.drafted_tokens = self.accepted_tokens = 0
        return snapshot
