"""ForwardBatch: the one forward contract shared by every architecture.

A step is a flat varlen batch of new tokens from several requests (prefill chunks,
decode rows and, later, speculative verification rows are all the same call) plus
where each request's cache lives: KV pages for attention layers and a state slot for
Gated DeltaNet layers. Request b owns flat rows [query_start_loc[b], query_start_loc[b+1]).

The runner builds its steps with `ForwardBatch.stage` into a `HostStaging`: one host buffer
(pinned on CUDA) per step and one non-blocking copy per flush. `ForwardBatch.build` is the
plain version (a synchronous copy per tensor from pageable memory) for tests and tools.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ninfer.models.kv_cache import KVCache
from ninfer.models.padded_step import PaddedStep
from ninfer.models.state_cache import StateCache
from ninfer.models.step_snapshots import StepSnapshots
from ninfer.models.verify_scratch import VerifyRows

# Every staged array starts on this byte boundary: dtype views of the byte buffer need their
# element size, and Triton specializes its kernels on 16-byte aligned pointers.
_STAGING_ALIGN = 16
_MIN_STAGING_BYTES = 16 << 10
_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
}


class HostStaging:
    """Moves a step's host-side metadata to the device without blocking the host.

    add() packs a host array into this step's host buffer and returns the device view it will
    occupy; flush() copies everything added since the last flush in one transfer (pinned
    memory, non_blocking on CUDA). A view holds its values once flushed: flush before any
    kernel reads it. On the CPU the views are the host buffer itself and flush() does nothing.
    """

    def __init__(self, device: torch.device | str, num_turns: int = 1):
        """num_turns: steps whose buffers stay untouched while a newer step is packed."""
        self.device = torch.device(device)
        self._pinned = self.device.type == "cuda"
        self._host: list[torch.Tensor | None] = [None] * num_turns  # uint8, grown on demand
        self._host_bytes: list[np.ndarray | None] = [None] * num_turns  # numpy views of _host
        self._device: list[torch.Tensor | None] = [None] * num_turns  # the same tensor on the CPU
        self._copied = [torch.cuda.Event() for _ in range(num_turns)] if self._pinned else None
        self._turn = -1
        self._used = 0  # bytes of the current buffer taken this step
        self._flushed = 0  # of which already copied

    def next_step(self) -> None:
        """Start packing a new step into the next turn's buffers."""
        self._turn = (self._turn + 1) % len(self._host)
        self._used = self._flushed = 0
        if self._copied is not None:
            # Rewrite a pinned buffer only once the copies out of it have finished (the step
            # that used it was num_turns steps ago: normally long done, so this does not wait).
            self._copied[self._turn].synchronize()
        else:
            # On the CPU the step's tensors are views of the buffer: a fresh one keeps them intact.
            self._host[self._turn] = self._host_bytes[self._turn] = self._device[self._turn] = None

    def add(self, array: np.ndarray) -> torch.Tensor:
        """Stage a host array; -> its device tensor (same dtype and shape), valid after flush()."""
        if self._turn < 0:
            raise RuntimeError("HostStaging.next_step() must start each step")
        array = np.ascontiguousarray(array)
        start, end = self._used, self._used + array.nbytes
        host = self._host_bytes[self._turn]
        if host is None or end > len(host):
            self._grow(array.nbytes)
            host, start, end = self._host_bytes[self._turn], 0, array.nbytes
        host[start:end] = array.reshape(-1).view(np.uint8)
        self._used = -(-end // _STAGING_ALIGN) * _STAGING_ALIGN
        return self._device[self._turn][start:end].view(_TORCH_DTYPES[array.dtype]).view(array.shape)

    def flush(self) -> None:
        """Copy what was added since the last flush to the device (one transfer, queued on CUDA)."""
        if self._pinned and self._used > self._flushed:
            span = slice(self._flushed, self._used)
            self._device[self._turn][span].copy_(self._host[self._turn][span], non_blocking=True)
            self._copied[self._turn].record(torch.cuda.current_stream(self.device))
        self._flushed = self._used

    def _grow(self, nbytes: int) -> None:
        """New, larger buffers for this turn. Views handed out earlier this step keep the old
        device buffer alive, so its pending range is copied first; the old pinned buffer returns
        to PyTorch's host allocator, which reuses it only after that copy has completed."""
        self.flush()
        old = self._host[self._turn]
        capacity = max(_MIN_STAGING_BYTES, 2 * (old.numel() if old is not None else 0))
        while capacity < nbytes:
            capacity *= 2
        host = torch.empty(capacity, dtype=torch.uint8, pin_memory=self._pinned)
        self._host[self._turn], self._host_bytes[self._turn] = host, host.numpy()
        self._device[self._turn] = torch.empty(capacity, dtype=torch.uint8, device=self.device) if self._pinned else host
        self._used = self._flushed = 0


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
    query_lens_cpu: tuple[int, ...] | None = ()
    seq_lens_cpu: tuple[int, ...] | None = ()
    # Speculative verification: the first requests score their rows without writing state slots.
    verify: VerifyRows | None = None
    # A drafter's view of the trunk (off when empty): the residual stream after each named layer,
    # written for every row into aux_hidden [T, len(aux_layer_ids), H] (preallocated by the caller).
    aux_layer_ids: tuple[int, ...] = ()
    aux_hidden: torch.Tensor | None = None
    # Media: these flat rows take the vision tower's output [M, H] instead of their token embedding.
    media_rows: torch.Tensor | None = None
    media_embeds: torch.Tensor | None = None
    # Checkpoints captured inside the step (its last requests continue earlier ones).
    snapshots: StepSnapshots | None = None
    # A step at a captured graph's fixed shape: empty requests and rows of none pad it, and the
    # host copies of the lengths above are None (every kernel reads the device tensors).
    padded: PaddedStep | None = None

    @property
    def num_requests(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @property
    def max_query_len(self) -> int:
        """Host-side size for kernel grids; a captured decode batch has 1 on every replay."""
        if self.padded is not None:
            return self.padded.max_query_len
        return max(self.query_lens_cpu, default=0)

    @property
    def is_decode_only(self) -> bool:
        return (
            self.verify is None
            and self.snapshots is None
            and self.padded is None
            and all(q == 1 for q in self.query_lens_cpu)
        )

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

    @classmethod
    def stage(
        cls,
        query_lens: Sequence[int],
        num_computed_tokens: Sequence[int],
        page_ids: Sequence[Sequence[int]],
        state_slots: Sequence[int],
        kv_cache: KVCache | None,
        state_cache: StateCache | None,
        logits_indices: Sequence[int],
        staging: HostStaging,
        mrope: bool = False,
        rope_positions: Sequence[np.ndarray | None] | None = None,
    ) -> ForwardBatch:
        """build() with text positions and the page table given as each request's page ids
        (rows padded with page 0), packed into `staging`: the tensors hold their values on
        staging.device once the caller has flushed it.

        rope_positions (MRoPE models): per request, its tokens' [3, query_len] rotary positions
        where they are not the text positions (a request with media), else None."""
        num_requests = len(query_lens)
        new_tokens = np.asarray(query_lens, dtype=np.int64)
        computed = np.asarray(num_computed_tokens, dtype=np.int64)
        starts = np.zeros(num_requests + 1, dtype=np.int64)
        np.cumsum(new_tokens, out=starts[1:])
        # Token t of request b sits at position computed[b] + (t - starts[b]).
        positions = np.arange(starts[-1]) + np.repeat(computed - starts[:-1], new_tokens)
        seq_lens = computed + new_tokens
        table = np.zeros((num_requests, max(map(len, page_ids), default=0)), dtype=np.int32)
        for row, pages in enumerate(page_ids):
            table[row, : len(pages)] = pages
        slot_mapping = None
        if kv_cache is not None:
            page_size = kv_cache.page_size
            rows = np.repeat(np.arange(num_requests), new_tokens)
            pages = table[rows, positions // page_size].astype(np.int64)
            slot_mapping = staging.add(pages * page_size + positions % page_size)
        rotary = np.broadcast_to(positions, (3, len(positions))) if mrope else positions
        if mrope and rope_positions is not None and any(p is not None for p in rope_positions):
            rotary = np.array(rotary)
            for row, explicit in enumerate(rope_positions):
                if explicit is not None:
                    rotary[:, starts[row] : starts[row + 1]] = explicit
        return cls(
            positions=staging.add(rotary),
            query_start_loc=staging.add(starts.astype(np.int32)),
            seq_lens=staging.add(seq_lens.astype(np.int32)),
            page_table=staging.add(table),
            state_slots=staging.add(np.asarray(state_slots, dtype=np.int64)),
            logits_indices=staging.add(np.asarray(logits_indices, dtype=np.int64)),
            slot_mapping=slot_mapping,
            kv_cache=kv_cache,
            state_cache=state_cache,
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=tuple(seq_lens.tolist()),
        )
