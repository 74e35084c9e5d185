"""PaddedStep: a prompt or mixed step at the fixed shape of a captured CUDA graph.

A graph replays the same kernels over the same buffers, so a step must fit a token bucket and
a request count fixed at capture: the step's requests fill the first rows of the request table,
the rest are empty requests (no rows, the runner's scratch state slot), and the flat token rows
past the last request's belong to no request (their KV goes to a scratch page, their outputs
are never read). Kernels that work per request then read where each request's rows start from
the device, and size their grids by the bounds here.

Gated DeltaNet layers run the rule in one or two passes (`RuleSegments`): with checkpoints
inside the step (StepSnapshots), the requests that continue an earlier one of the batch on the
same slot run in a second pass, after the slot's state at the frontier has been copied to the
checkpoint's slot. Each pass sees the requests outside it as empty, with the scratch slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The chunked gated delta rule's chunk length, in tokens; chunk_indices count in these units.
RULE_CHUNK = 64


@dataclass(frozen=True)
class RuleSegments:
    """One pass of the conv and the gated delta rule over some of a padded step's requests.

    Request b of the pass owns rows [starts[b], starts[b + 1]); requests outside the pass are
    empty. chunk_indices lists (request, chunk within it) of every RULE_CHUNK-token chunk of the
    pass, padded with (the last request, which is always empty, 0)."""

    state_slots: torch.Tensor  # [R] int64
    conv_starts: torch.Tensor  # [R + 1] int32 (the conv kernel's offsets)
    starts: torch.Tensor  # [R + 1] int64 (the rule's offsets)
    chunk_indices: torch.Tensor  # [max_chunks, 2] int64
    chunk_offsets: torch.Tensor  # [R + 1] int64: chunks before each request


@dataclass(frozen=True)
class PaddedStep:
    max_query_len: int  # a bound on any request's rows: grid sizes of per-request kernels
    passes: tuple[RuleSegments, ...]  # one, or two with checkpoints inside the step
    second_pass_rows: torch.Tensor | None = None  # [T, 1, 1] bool: the rows the second pass computes

    @staticmethod
    def max_chunks(max_tokens: int, max_requests: int) -> int:
        """Chunks any pass can have: each request's last chunk may be partial."""
        return max_tokens // RULE_CHUNK + max_requests
