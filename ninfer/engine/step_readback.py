"""StepReadback: the pinned host buffers and events that bring launched steps' results back.

A step's sampled ids (and its speculative rows' outcomes, its log probabilities) are copied to
pinned host memory behind its work, without blocking the host; PendingStep reads them once the
step's event has fired. One set of buffers per step that may be unread at once (the round in
flight and the one launched ahead of it); a set is refilled only after its step was read.
"""

from __future__ import annotations

import torch

from ninfer.engine.pending_step import PendingStep
from ninfer.engine.scheduler import SchedulerStep

# Launched steps whose ids the host has not read: the current round and the one launched
# ahead of it. The pinned buffers come in this many copies.
MAX_UNREAD_STEPS = 2
# Alternatives a row's log probabilities may list (OpenAI's top_logprobs range).
MAX_TOP_LOGPROBS = 20


class StepReadback:
    def __init__(self, device: torch.device, max_rows: int, num_draft_tokens: int):
        """max_rows: the most rows a step has (every running request holds a state slot, so no
        step has more rows than slots); num_draft_tokens: K of a speculative row's outcome."""
        pin = device.type == "cuda"
        self._ids = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(MAX_UNREAD_STEPS)]
        # Speculative outcomes (accepted count, K+1 tokens, K drafts per verification row), likewise.
        width = 2 * num_draft_tokens + 2
        self._verified = [
            torch.zeros(max_rows, width, dtype=torch.int64, pin_memory=pin) for _ in range(MAX_UNREAD_STEPS)
        ]
        # Log probabilities of the rows that ask for them: the sampled token's, then the top ones'
        # values, then their ids (exact in float64), one row per asking row.
        self._logprobs = [
            torch.zeros(max_rows, 1 + 2 * MAX_TOP_LOGPROBS, dtype=torch.float64, pin_memory=pin)
            for _ in range(MAX_UNREAD_STEPS)
        ]
        # Recorded after each launch's copy; re-recorded only once that launch has been read.
        self._ready = [torch.cuda.Event() for _ in range(MAX_UNREAD_STEPS)] if pin else None
        self._num_launches = 0
        self.num_unread = 0

    def check_room(self) -> None:
        if self.num_unread >= MAX_UNREAD_STEPS:
            raise RuntimeError(f"{MAX_UNREAD_STEPS} launched steps are unread: read the oldest first")

    def pending(
        self,
        step: SchedulerStep,
        ids: torch.Tensor | None,
        sampled_rows: list[int],
        verified: torch.Tensor | None = None,
        logprobs: tuple[list[int], torch.Tensor] | None = None,
    ) -> PendingStep:
        """Queue the copies of a launched step's results into the next turn's buffers; -> the
        PendingStep that reads them."""
        turn = self._num_launches % MAX_UNREAD_STEPS
        self._num_launches += 1
        ids_host, verified_host, ready, logprobs_host = None, None, None, None
        if ids is not None:
            ids_host = self._ids[turn][: len(ids)]
            ids_host.copy_(ids, non_blocking=True)
        if verified is not None:
            verified_host = self._verified[turn][: len(verified)]
            verified_host.copy_(verified, non_blocking=True)
        if logprobs is not None:
            rows, packed = logprobs
            host = self._logprobs[turn][: len(rows)]
            host.copy_(packed, non_blocking=True)
            logprobs_host = (rows, host)
        if self._ready is not None:
            ready = self._ready[turn]
            ready.record()
        self.num_unread += 1
        return PendingStep(
            step, sampled_rows, ids_host, ready, on_read=self._read_one, verified_host=verified_host,
            logprobs_host=logprobs_host,
        )

    def _read_one(self) -> None:
        self.num_unread -= 1

    def abandon(self) -> None:
        """A step failed: its launched steps will never be read."""
        self.num_unread = 0
