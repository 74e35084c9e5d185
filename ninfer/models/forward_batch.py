"""ForwardBatch: the one forward contract shared by every architecture.

A step is a flat varlen batch of new tokens from several requests (prefill chunks,
decode rows and, later, speculative verification rows are all the same call) plus
where each request's cache lives: KV pages for attention layers and a state slot for
Gated DeltaNet layers. Request b owns flat rows [query_start_loc[b], query_start_loc[b+1]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.models.kv_cache import KVCache
from ninfer.models.state_cache import StateCache


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [T] int64; [3, T] (t, h, w) for MRoPE models
    query_start_loc: torch.Tensor  # [B + 1] int32, cu_seqlens of the new tokens
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache after this step (computed + new)
    page_table: torch.Tensor  # [B, max_pages] int32 page ids into kv_cache (unused rows may hold -1)
    state_slots: torch.Tensor  # [B] int64 slot ids into state_cache
    logits_indices: torch.Tensor  # [L] int64 flat rows that need logits
    slot_mapping: torch.Tensor | None = None  # [T] int64 page * page_size + offset of each new token's KV
    kv_cache: KVCache | None = None
    state_cache: StateCache | None = None
    # Host copies so reference ops can loop per request without device syncs.
    query_lens_cpu: tuple[int, ...] = ()
    seq_lens_cpu: tuple[int, ...] = ()

    @property
    def num_requests(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @property
    def max_query_len(self) -> int:
        """Host-side size for kernel grids; a captured decode batch has 1 on every replay."""
        return max(self.query_lens_cpu, default=0)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens_cpu)

    def num_computed_tokens(self, request_index: int) -> int:
        """Tokens already in the cache before this step for request b."""
        return self.seq_lens_cpu[request_index] - self.query_lens_cpu[request_index]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        num_computed_tokens: list[int],
        page_table: torch.Tensor,
        state_slots: list[int],
        kv_cache: KVCache | None,
        state_cache: StateCache | None,
        logits_indices: list[int] | None = None,
        positions: torch.Tensor | None = None,
        mrope: bool = False,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Build a batch from host lists (positions default to text positions).

        logits_indices defaults to the last new token of every request.
        """
        seq_lens = [c + q for c, q in zip(num_computed_tokens, query_lens)]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        if positions is None:
            pos = torch.cat(
                [torch.arange(c, c + q, dtype=torch.int64) for c, q in zip(num_computed_tokens, query_lens)]
            ) if query_lens else torch.zeros(0, dtype=torch.int64)
            positions = pos.unsqueeze(0).expand(3, -1).contiguous() if mrope else pos
        if logits_indices is None:
            logits_indices = [s - 1 for s in starts[1:]]
        slot_mapping = None
        if kv_cache is not None:
            # One gather instead of a Python loop per token (prefill chunks hold thousands).
            page_size = kv_cache.page_size
            token_pos = torch.cat(
                [torch.arange(c, c + q, dtype=torch.int64) for c, q in zip(num_computed_tokens, query_lens)]
            ) if query_lens else torch.zeros(0, dtype=torch.int64)
            rows = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens, dtype=torch.int64))
            table = page_table.to(torch.int64)
            token_pos, rows = token_pos.to(table.device), rows.to(table.device)
            pages = table[rows, token_pos // page_size]
            slot_mapping = (pages * page_size + token_pos % page_size).to(device)
        return cls(
            positions=positions.to(device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            page_table=page_table.to(device=device, dtype=torch.int32),
            state_slots=torch.tensor(state_slots, dtype=torch.int64, device=device),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
            slot_mapping=slot_mapping,
            kv_cache=kv_cache,
            state_cache=state_cache,
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=tuple(seq_lens),
        )
