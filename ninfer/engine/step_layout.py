"""StepLayout: a step's chunks as the requests and flat rows of one forward batch.

A chunk is one request of the batch, except a chunk with a checkpoint inside it: its rows before
the frontier are one request (their last row's logits go to the checkpoint's slot) and the rest,
placed last in the batch, another on the same slot (models/step_snapshots.py). The eager forward
and the step graphs both lay a step out this way.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from ninfer.engine.scheduler import ScheduledChunk


@dataclass(frozen=True)
class ForwardPart:
    """Tokens [start, end) of a chunk, as one request of the forward batch."""

    chunk: ScheduledChunk
    start: int
    end: int

    @property
    def is_snapshot(self) -> bool:
        """The rows before a snapshot's frontier: their last row's logits belong to the checkpoint."""
        return self.chunk.snapshot_slot is not None and self.end == self.chunk.snapshot_tokens

    @property
    def token_ids(self) -> list[int]:
        ids = self.chunk.token_ids
        return ids if self.start == 0 and self.end == len(ids) else ids[self.start : self.end]

    @property
    def rope_positions(self) -> np.ndarray | None:
        positions = self.chunk.rope_positions
        return positions if positions is None else positions[:, self.start : self.end]

    @property
    def num_computed_tokens(self) -> int:
        return self.chunk.num_computed_tokens + self.start


@dataclass(frozen=True)
class StepLayout:
    parts: list[ForwardPart]
    snapshotting: list[ScheduledChunk]  # chunks with a checkpoint inside; their second parts come last
    logits_rows: list[int]  # flat rows whose logits are kept
    logits_slots: list[int]  # the slot each of those rows' logits go to
    chained_offsets: list[int]  # flat rows whose token is an id the previous step sampled ...
    chained_rows: list[int]  # ... in this row of that step

    @classmethod
    def of(cls, chunks: list[ScheduledChunk]) -> StepLayout:
        snapshotting = [c for c in chunks if c.snapshot_slot is not None]
        parts = [ForwardPart(c, 0, c.snapshot_tokens if c.snapshot_slot is not None else len(c.token_ids))
                 for c in chunks]
        parts += [ForwardPart(c, c.snapshot_tokens, len(c.token_ids)) for c in snapshotting]
        logits_rows: list[int] = []
        logits_slots: list[int] = []
        chained_offsets: list[int] = []
        chained_rows: list[int] = []
        offset = 0
        for part in parts:
            chunk = part.chunk
            if chunk.previous_row is not None:
                chained_offsets.append(offset)
                chained_rows.append(chunk.previous_row)
            offset += part.end - part.start
            if part.is_snapshot:
                logits_rows.append(offset - 1)
                logits_slots.append(chunk.snapshot_slot)
            elif chunk.compute_logits and not chunk.speculative:
                logits_rows.append(offset - 1)
                logits_slots.append(chunk.state_slot)
        return cls(parts, snapshotting, logits_rows, logits_slots, chained_offsets, chained_rows)

    @property
    def query_lens(self) -> list[int]:
        return [part.end - part.start for part in self.parts]

    @property
    def num_tokens(self) -> int:
        return sum(part.end - part.start for part in self.parts)

    @property
    def num_continuing(self) -> int:
        """The batch's last requests that continue an earlier one (a checkpoint inside its chunk)."""
        return len(self.snapshotting)

    def token_array(self) -> np.ndarray:
        return np.fromiter(chain.from_iterable(p.token_ids for p in self.parts), dtype=np.int64, count=self.num_tokens)
