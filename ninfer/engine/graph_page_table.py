"""GraphPageTable: the static page table a set of CUDA graphs reads, one row per graph row.

A request's pages are fixed at admission, so a row changes only when another request lands on
it: each row remembers the page list it holds and is uploaded (a pinned, non-blocking copy)
only when that list changes.
"""

from __future__ import annotations

import torch


class GraphPageTable:
    def __init__(self, max_rows: int, max_pages_per_row: int, device: torch.device):
        self.table = torch.zeros(max_rows, max_pages_per_row, dtype=torch.int32, device=device)
        self.device = device
        self._rows: list[list[int] | None] = [None] * max_rows

    def upload(self, row: int, page_ids: list[int]) -> None:
        cached = self._rows[row]
        # A request's page list is one object from admission to release (never changed in place):
        # identity is the common case and costs nothing at long contexts.
        if cached is page_ids or cached == page_ids:
            return
        pages = torch.tensor(page_ids, dtype=torch.int32)
        if self.device.type == "cuda":
            pages = pages.pin_memory()
        self.table[row, : len(page_ids)].copy_(pages, non_blocking=True)
        self._rows[row] = page_ids

    def forget(self) -> None:
        """The table was written behind our back (capture): upload every row again."""
        self._rows = [None] * len(self._rows)
