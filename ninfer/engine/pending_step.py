"""PendingStep: a launched step whose sampled token ids are still on their way to the host.

The runner enqueues the step's kernels and a non-blocking copy of the sampled ids into a
pinned host buffer, records an event, and returns at once; result() waits for that event
only. A later step enqueued in between (the engine's next decode round, launched before
this one is read) therefore does not delay the read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ninfer.contract.output import TokenLogprobs
from ninfer.engine.scheduler import SchedulerStep, VerifyOutcome


class PendingStep:
    def __init__(
        self,
        step: SchedulerStep,
        sampled_rows: list[int],
        ids_host: torch.Tensor | None,
        ready: torch.cuda.Event | None,
        on_read: Callable[[], None] | None = None,
        verified_host: torch.Tensor | None = None,
        logprobs_host: tuple[list[int], torch.Tensor] | None = None,
    ):
        """sampled_rows: the chunks (by index) that sample; ids_host holds one id per chunk.
        ready: recorded after the step's work and the copy into ids_host (None: all done
        already); on_read: called once, when the result is first read. verified_host: the
        speculative rows' outcomes, one row per speculative chunk (they come first): accepted
        count, K+1 tokens, K drafts. logprobs_host: (the rows that asked for log probabilities,
        one host row each: the token's log probability, then the top values, then their ids,
        each part as wide as the runner's alternatives cap)."""
        self.step = step
        self._sampled_rows = sampled_rows
        self._ids_host = ids_host
        self._ready = ready
        self._on_read = on_read
        self._verified_host = verified_host
        self._logprobs_host = logprobs_host
        self._result: dict[str, int] | None = None
        self._verified: dict[str, VerifyOutcome] = {}
        self._logprobs: dict[str, TokenLogprobs] = {}

    def result(self) -> dict[str, int]:
        """request id -> sampled token id, for every chunk that samples (blocks until ready)."""
        if self._result is None:
            if self._ready is not None:
                self._ready.synchronize()
            values = self._ids_host.tolist() if self._sampled_rows else []
            chunks = self.step.chunks
            self._result = {chunks[row].request_id: values[row] for row in self._sampled_rows}
            if self._verified_host is not None:
                speculative = [c for c in chunks if c.speculative and c.token_ids]
                num_tokens = (self._verified_host.shape[1] - 2) // 2 + 1
                for chunk, row in zip(speculative, self._verified_host.tolist()):
                    accepted = row[0]
                    self._verified[chunk.request_id] = VerifyOutcome(
                        tokens=row[1 : accepted + 2], drafts=row[1 + num_tokens :]
                    )
            if self._logprobs_host is not None:
                rows, host = self._logprobs_host
                cap = (host.shape[1] - 1) // 2
                for row, values in zip(rows, host.tolist()):
                    chunk = chunks[row]
                    # Tokens a constraint leaves out (-inf) are no alternatives: fewer may remain.
                    top = [(int(i), v) for i, v in zip(values[1 + cap : 1 + cap + (chunk.logprobs or 0)], values[1:])
                           if v != float("-inf")]
                    self._logprobs[chunk.request_id] = TokenLogprobs(
                        values[0], [i for i, _ in top], [v for _, v in top]
                    )
            if self._on_read is not None:
                self._on_read()
        return self._result

    def logprobs(self) -> dict[str, TokenLogprobs]:
        """request id -> log probabilities of its sampled token, for the rows that asked (read
        after result())."""
        self.result()
        return self._logprobs

    def verified(self) -> dict[str, VerifyOutcome]:
        """request id -> outcome of each speculative row (read after result())."""
        self.result()
        return self._verified
