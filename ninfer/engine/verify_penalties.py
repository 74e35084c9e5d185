"""VerifyPenalties: presence and frequency penalties inside the verify graphs (verify_graphs.py).

A penalised request's output tokens change length every round, so they cannot be captured as a
list. They travel instead as flat indices (request × V + token, one per occurrence) in a fixed
buffer, of which a round copies only the prefix it filled, with the count of live entries in the
round's other inputs. Inside the graph the entries are counted into a [B, V] table, each
verification row takes its request's counts plus the drafts before it (what the eager plan lists
per row, spec_plan.py), and Sampler.penalize_ subtracts presence and frequency as the eager
sampler does. Every general round adds all entries, live or not: the buffer holds
ENTRIES_PER_REQUEST per request, and a round whose penalised outputs are longer runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.engine.scheduler import ScheduledChunk
from ninfer.engine.scheduler.chunks import has_penalties
from ninfer.engine.static_inputs import StaticInputs

# Non-thinking outputs, the ones a preset penalises, rarely pass a few thousand tokens: the buffer
# stays a few hundred KiB.
ENTRIES_PER_REQUEST = 16384


class VerifyPenalties:
    def __init__(self, max_batch: int, max_tokens_per_request: int, vocab_size: int, num_draft_tokens: int,
                 device: torch.device):
        self.vocab_size = vocab_size
        self.num_draft_tokens = num_draft_tokens
        self.device = device
        self.capacity = max_batch * min(max_tokens_per_request, ENTRIES_PER_REQUEST)
        self.entries = StaticInputs({"index": ((self.capacity,), torch.int32)}, device)
        self._entry_numbers = torch.arange(self.capacity, device=device)

    def fits(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether the penalised requests' output tokens fit the buffer."""
        return sum(len(c.output_token_ids) for c in chunks if has_penalties(c.sampling)) <= self.capacity

    def fill(self, chunks: Sequence[ScheduledChunk]) -> int:
        """Write the penalised rows' output tokens as row * V + token and queue their copy; -> how
        many (the round's live entries; 0 and nothing copied without penalties)."""
        penalised = [(row, c.output_token_ids) for row, c in enumerate(chunks) if has_penalties(c.sampling)]
        if not penalised:
            return 0
        index = self.entries.next_mirror()["index"]
        num_entries = 0
        for row, tokens in penalised:
            end = num_entries + len(tokens)
            index[num_entries:end] = tokens
            index[num_entries:end] += row * self.vocab_size
            num_entries = end
        self.entries.upload(num_entries * 4)
        return num_entries

    def counts(self, batch_size: int, num_entries: torch.Tensor, drafts: torch.Tensor,
               num_drafts: torch.Tensor) -> torch.Tensor:
        """Captured: each verification row's output token counts [B * (K+1), V] fp32, from the live
        entries (num_entries [1]) and the drafts [B, K] before the row (num_drafts [B] considered)."""
        k, vocab = self.num_draft_tokens, self.vocab_size
        live = self._entry_numbers < num_entries
        # Entries past this round's count are an earlier round's: weight 0, each at an address of its
        # own in range (atomic adds to one address would queue behind each other).
        index = torch.where(live, self.entries.views["index"].long(), self._entry_numbers % (batch_size * vocab))
        table = torch.zeros(batch_size * vocab, dtype=torch.float32, device=self.device)
        table.index_add_(0, index, live.float())
        counts = table.view(batch_size, vocab).repeat_interleave(k + 1, dim=0)
        place = torch.arange(k, device=self.device)
        row = torch.arange(k + 1, device=self.device)
        before = (place[None, None, :] < row[None, :, None]) & (place[None, None, :] < num_drafts[:, None, None])
        rows = torch.arange(batch_size * (k + 1), device=self.device).view(batch_size, k + 1, 1)
        flat = rows * vocab + drafts[:, None, :]
        counts.view(-1).index_add_(0, flat.reshape(-1), before.reshape(-1).float())
        return counts
