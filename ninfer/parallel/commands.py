"""The commands rank 0 sends its followers: the runner calls they repeat on their shards, in order.

Each carries exactly what the runner consumes from the scheduler (the typed SchedulerStep, the
masks of a deferred round), so the followers' KV pools and state slots take the same page and
slot ids as rank 0's: one logical pool over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ninfer.engine.scheduler import SchedulerStep


@dataclass(frozen=True)
class CreateRunner:
    """Build a ModelRunner with these arguments (rank 0's EngineCore just built its own), replacing
    any earlier one (the --kv-capacity auto probe's)."""

    arguments: dict


@dataclass(frozen=True)
class Launch:
    step: SchedulerStep


@dataclass(frozen=True)
class SampleDeferred:
    """Sample the last launched step, whose rows waited for their masks (by row)."""

    masks: dict[int, np.ndarray | None]


@dataclass(frozen=True)
class AgreeKvTokens:
    """--kv-capacity auto on CUDA: each rank sizes its pool from its own free memory less what the
    probe measured; the smallest answer wins (the ranks' pools hold the same pages)."""

    reserved_bytes: int  # headroom, worst step, graphs, state slots: what the pool must leave free
    page_bytes: int
    page_size: int
    max_tokens: int  # what the state slots can use at most


@dataclass(frozen=True)
class ReportMemory:
    """Every follower answers with its memory ledger (gathered for the server_start record)."""


@dataclass(frozen=True)
class Stop:
    pass


Command = CreateRunner | Launch | SampleDeferred | AgreeKvTokens | ReportMemory | Stop
