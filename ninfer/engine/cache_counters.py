"""CacheCounters: what the context cache did over one throughput interval (its JSONL record).

Selection (admissions that reused a checkpoint, by path, and the tokens reused; those that
started from the root), capture (checkpoints kept, by path), transfer (StateImage and KV
spills to the host tier and restores back), copy-on-write pages, adoptions (a request took a
checkpoint's slot over) and drops. take() returns the deltas and starts a new interval.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class CacheCounters:
    hits: Counter = field(default_factory=Counter)  # admissions resuming a checkpoint, by its path
    hit_tokens: int = 0
    misses: int = 0  # admissions from the root
    captures: Counter = field(default_factory=Counter)  # checkpoints kept, by path
    state_spills: int = 0
    state_restores: int = 0
    kv_spills: int = 0  # checkpoints whose KV moved to the host tier
    kv_restores: int = 0
    cow_pages: int = 0
    adoptions: int = 0
    drops: int = 0  # checkpoints given up (pressure, descriptor limits, a failed step)

    def take(self, occupancy: int) -> dict:
        record = {
            "selection": {"hits": dict(self.hits), "hit_tokens": self.hit_tokens, "misses": self.misses},
            "capture": dict(self.captures),
            "transfer": {"state_spills": self.state_spills, "state_restores": self.state_restores,
                         "kv_spills": self.kv_spills, "kv_restores": self.kv_restores},
            "cow_pages": self.cow_pages,
            "adoptions": self.adoptions,
            "drops": self.drops,
            "occupancy": occupancy,
        }
        self.__init__()
        return record
