"""StepSnapshots: checkpoints captured inside a step, at a frontier within a request's chunk.

A request's chunk that crosses a capture frontier F runs as two requests of the batch on the
same state slot: the rows before F, then the rows from F (a continuing request, placed last in
the batch). Attention needs nothing more (the KV of both parts is written before it reads);
Gated DeltaNet layers run the continuing requests after the others, once each one's slot state
(after its rows before F) has been copied into the checkpoint's slot. So the prompt's tail past
a frontier (a chat's generation prompt after its turn closure) costs no step of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepSnapshots:
    src_slots: torch.Tensor  # [N] int64: the continuing requests' slots (their state at F after the first part)
    dst_slots: torch.Tensor  # [N] int64: the checkpoints' slots
    num_continuing_requests: int  # the batch's last N requests continue earlier ones
