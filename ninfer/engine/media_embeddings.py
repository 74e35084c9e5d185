"""MediaEmbeddings: the vision tower's output per media item, on the device, for prompt steps.

A step's media tokens arrive as identity ids (contract/media.py). Items not yet encoded are
run through the tower together, once; their rows stay here (least recently used dropped past
a token bound) because a long item's tokens can span several prompt chunks, and a repeated
image in a later request whose prefix was not reused needs the same rows again.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence

import numpy as np
import torch

from ninfer.contract.media import PATCH_VALUES, MediaInput, identity_parts, is_media_identity

# Rows kept: twice the vision envelope (32,768 merged tokens per prompt), so the items of the
# step being built are never the ones dropped.
DEFAULT_CAPACITY_TOKENS = 65_536


class MediaEmbeddings:
    def __init__(self, tower: torch.nn.Module, device: torch.device, capacity_tokens: int = DEFAULT_CAPACITY_TOKENS):
        self.tower = tower
        self.device = device
        self.dtype = next(tower.parameters()).dtype
        self.capacity_tokens = capacity_tokens
        self._rows: collections.OrderedDict[int, torch.Tensor] = collections.OrderedDict()  # identity key -> [tokens, H]
        self.num_encoded_items = 0  # for tests and the request log

    def encode(self, items: Sequence[MediaInput]) -> float:
        """Run the tower over the items not held yet (one call for all of them); -> its seconds,
        0.0 when every item was held. On CUDA it waits for the tower, so the time is the tower's:
        this happens once per new item, where a prompt step has its own long forward anyway."""
        missing: dict[int, MediaInput] = {}
        for item in items:
            key = item.identity_key
            if key in self._rows:
                self._rows.move_to_end(key)
            else:
                missing.setdefault(key, item)
        if not missing:
            return 0.0
        started = time.perf_counter()
        patches = torch.cat([self._patches(item) for item in missing.values()]).to(self.device, self.dtype)
        grids = [item.grid_thw for item in missing.values()]
        embeds = self.tower(patches, grids)
        offset = 0
        for key, item in missing.items():
            self._rows[key] = embeds[offset : offset + item.num_tokens]
            offset += item.num_tokens
        self.num_encoded_items += len(missing)
        self._evict(keep=set(missing) | {item.identity_key for item in items})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    @staticmethod
    def _patches(item: MediaInput) -> torch.Tensor:
        flat = torch.frombuffer(bytearray(item.patches), dtype=torch.bfloat16)
        return flat.view(item.num_patches, PATCH_VALUES)

    @property
    def held_tokens(self) -> int:
        """Encoded rows held for prompt steps now."""
        return sum(rows.shape[0] for rows in self._rows.values())

    def _evict(self, keep: set[int]) -> None:
        held = sum(rows.shape[0] for rows in self._rows.values())
        for key in list(self._rows):
            if held <= self.capacity_tokens:
                break
            if key not in keep:
                held -= self._rows.pop(key).shape[0]

    def gather(self, token_ids: np.ndarray) -> tuple[np.ndarray, torch.Tensor] | None:
        """The flat rows of a step's input that are media tokens, and their tower rows [M, H];
        None when the step has none. Every item must have been encoded."""
        rows = np.flatnonzero(is_media_identity(token_ids))
        if len(rows) == 0:
            return None
        parts = []
        keys, indices = identity_parts(token_ids[rows])
        # Runs of the same item are contiguous in a prompt: one index_select per run.
        boundaries = np.flatnonzero(np.diff(keys)) + 1
        for run in np.split(np.arange(len(rows)), boundaries):
            item_rows = self._rows[int(keys[run[0]])]
            parts.append(item_rows.index_select(0, torch.as_tensor(indices[run], device=item_rows.device)))
        return rows, torch.cat(parts)
