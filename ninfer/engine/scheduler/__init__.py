"""The scheduler: admission, checkpoints, step planning and commit (pure CPU logic)."""

from ninfer.engine.scheduler.limits import SchedulerLimits
from ninfer.engine.scheduler.scheduler import Scheduler
from ninfer.engine.scheduler.stats import SchedulerStats
from ninfer.engine.scheduler.step import (
    PENDING_TOKEN,
    CommitVerified,
    CopyPage,
    CopySlot,
    ResetSlot,
    RestorePages,
    RestoreSlot,
    ScheduledChunk,
    SchedulerStep,
    SlotAction,
    SpillPages,
    SpillSlot,
    StepKind,
    VerifyOutcome,
)

__all__ = [
    "PENDING_TOKEN",
    "CommitVerified",
    "CopyPage",
    "CopySlot",
    "ResetSlot",
    "RestorePages",
    "RestoreSlot",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerLimits",
    "SchedulerStats",
    "SchedulerStep",
    "SlotAction",
    "SpillPages",
    "SpillSlot",
    "StepKind",
    "VerifyOutcome",
]
