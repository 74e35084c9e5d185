"""Test drafters that propose a known continuation (every draft accepted when it is the
target's own greedy output) or deliberately wrong tokens (every draft rejected).

OracleDrafter stands in for the backend's drafter (EngineCore(drafter=...)), reading the
accepted counts back to the host: a test tool, not a fast path. TableOracleDrafter does the
MTP head's whole work and then replaces its proposals by a table lookup on the device, so
the verify graphs capture it and a benchmark measures the cost of full acceptance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ninfer.contract.sampling import TOP_K_CAP
from ninfer.engine.speculative.acceptance import DraftProposal
from ninfer.engine.speculative.draft_round import DraftRound
from ninfer.engine.speculative.mtp_drafter import MtpDrafter


class OracleDrafter:
    def __init__(self, num_draft_tokens: int, sequences: dict[str, list[int]], wrong: bool = False,
                 vocab_size: int | None = None):
        """sequences: request id -> its whole token sequence (prompt and expected output);
        wrong: propose a different token than the sequence's at every position."""
        self.num_draft_tokens = num_draft_tokens
        self.sequences = sequences
        self.wrong = wrong
        self.vocab_size = vocab_size
        self.rounds = 0

    def draft(self, round: DraftRound) -> DraftProposal | None:
        if not round.num_verify:
            return None
        self.rounds += 1
        k = self.num_draft_tokens
        accepted = round.num_accepted.tolist()
        rows = []
        for chunk, num_accepted in zip(round.chunks, accepted):
            sequence = self.sequences.get(chunk.request_id, [])
            # The target's token after the accepted drafts sits at this position; drafts follow it.
            first = chunk.num_computed_tokens + 1 + num_accepted + 1  # after the pending token
            proposal = [sequence[i] if i < len(sequence) else 0 for i in range(first, first + k)]
            if self.wrong:
                proposal = [(t + 1) % (self.vocab_size or (t + 2)) for t in proposal]
            rows.append(proposal)
        device = round.hidden.device
        tokens = torch.tensor(rows, dtype=torch.int64, device=device)
        probs = torch.zeros(len(rows), k, TOP_K_CAP, dtype=torch.float32, device=device)
        probs[..., 0] = 1.0  # a deterministic proposal: q is one-hot on it
        candidates = tokens[..., None].expand(-1, -1, TOP_K_CAP).contiguous()
        return DraftProposal(tokens, probs, candidates)


def oracle_factory(num_draft_tokens: int, sequences: dict[str, list[int]], **kwargs) -> Callable[[], OracleDrafter]:
    return lambda: OracleDrafter(num_draft_tokens, sequences, **kwargs)


class TableOracleDrafter(MtpDrafter):
    """The MTP drafter with its proposals replaced by table[slot, position]: the token expected
    at each position of the sequence the slot holds (positions past the table repeat its last
    column). Reads device tensors only, like the MTP drafter, so it can be captured."""

    def __init__(self, model, head, num_draft_tokens: int, table: torch.Tensor):
        super().__init__(model, head, num_draft_tokens)
        self.table = table  # [num_slots, max_positions] int64 on the model's device

    def draft(self, round: DraftRound) -> DraftProposal | None:
        proposal = super().draft(round)  # the head's KV and its work, as the real drafter
        if proposal is None:
            return None
        inputs = round.inputs
        # The drafts follow the target's token after the accepted ones, at base + accepted.
        first = inputs.base + round.num_accepted + 1
        offsets = torch.arange(self.num_draft_tokens, device=first.device)
        positions = (first[:, None] + offsets).clamp_max(self.table.shape[1] - 1)
        tokens = self.table[inputs.slots[:, None], positions]
        probs = torch.zeros_like(proposal.probs)
        probs[..., 0] = 1.0
        return DraftProposal(tokens, probs, tokens[..., None].expand(-1, -1, TOP_K_CAP).contiguous())
