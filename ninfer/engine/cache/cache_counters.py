"""CacheCounters: what the context cache did over one throughput interval (its JSONL record).

Selection (admissions that reused a checkpoint, by path, and the tokens reused; those that
started from the root; those that resumed an older turn of a conversation that has gone on since:
a historical fork), capture (checkpoints kept, by path), transfer (StateImage and KV spills to
the host tier and restores back), copy-on-write pages, adoptions (a request took a checkpoint's
slot over), drops (every checkpoint given up: pressure, descriptor limits, a failed step) and
pressure: admission plans that had to choose victims, how their searches ended, those that hit a
search bound, those that fell back to the root although a checkpoint matched, and the
checkpoints pressure degraded (spilled to the host tier) or evicted, by owner (private
conversation or shared prefix). take() returns the deltas and starts a new interval;
last_selection (the latest admission decision) is a gauge and survives it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

OWNERS = ("private", "shared")
DEGRADATIONS = ("state_spills", "kv_spills", "evictions")


def _by_owner() -> dict[str, dict[str, int]]:
    return {owner: dict.fromkeys(DEGRADATIONS, 0) for owner in OWNERS}


@dataclass
class CacheCounters:
    hits: Counter = field(default_factory=Counter)  # admissions resuming a checkpoint, by its path
    hit_tokens: int = 0
    misses: int = 0  # admissions from the root
    historical_forks: int = 0  # resumed a private checkpoint its conversation has a later one past
    captures: Counter = field(default_factory=Counter)  # checkpoints kept, by path
    state_spills: int = 0
    state_restores: int = 0
    kv_spills: int = 0  # checkpoints whose KV moved to the host tier
    kv_restores: int = 0
    cow_pages: int = 0
    adoptions: int = 0
    drops: int = 0  # checkpoints given up (pressure, descriptor limits, a failed step)
    pressure_searches: int = 0  # admission plans accepted that had to choose victims
    pressure_stops: Counter = field(default_factory=Counter)  # how those searches ended (stop reason)
    budget_exhausted: int = 0  # accepted plans whose search hit a bound (targets, expansions, time, ranking)
    maximal_root_fallbacks: int = 0  # a checkpoint matched, yet the plan started from the root
    degradation: dict[str, dict[str, int]] = field(default_factory=_by_owner)  # pressure, by owner
    last_selection: dict[str, Any] | None = None  # gauge: the latest admission decision

    def degrade(self, shared: bool, kind: str) -> None:
        """Pressure spilled (state_spills, kv_spills) or evicted (evictions) a checkpoint."""
        self.degradation["shared" if shared else "private"][kind] += 1

    @property
    def has_activity(self) -> bool:
        """Anything counted this interval: an interval with cache work is reported even without tokens."""
        return bool(
            self.hits or self.misses or self.captures or self.state_spills or self.state_restores
            or self.kv_spills or self.kv_restores or self.cow_pages or self.adoptions or self.drops
            or self.pressure_searches
        )

    def take(self, occupancy: int) -> dict:
        record = {
            "selection": {"hits": dict(self.hits), "hit_tokens": self.hit_tokens, "misses": self.misses,
                          "historical_forks": self.historical_forks},
            "capture": dict(self.captures),
            "transfer": {"state_spills": self.state_spills, "state_restores": self.state_restores,
                         "kv_spills": self.kv_spills, "kv_restores": self.kv_restores},
            "cow_pages": self.cow_pages,
            "adoptions": self.adoptions,
            "drops": self.drops,
            "pressure": {
                "searches": self.pressure_searches,
                "stop_reasons": dict(self.pressure_stops),
                "budget_exhausted": self.budget_exhausted,
                "maximal_root_fallbacks": self.maximal_root_fallbacks,
                "degradation": {owner: dict(kinds) for owner, kinds in self.degradation.items()},
            },
            "occupancy": occupancy,
            "last_selection": self.last_selection,
        }
        last = self.last_selection
        self.__init__()
        self.last_selection = last
        return record
