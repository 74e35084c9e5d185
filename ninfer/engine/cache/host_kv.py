"""HostKV: the pinned host tier of KV pages, where checkpoints' KV goes under KV pressure.

Host pages are laid out page-major ([host_pages, layers, page_size, heads, head_dim]) so a run
of consecutive host pages is one contiguous block: a spill gathers the device pages in one
kernel and copies each run with one transfer, a restore the reverse. Copies are issued on the
compute stream without a host wait, ordered like the other slot actions. The buffers are
allocated empty: only spilled pages are ever written or read.
"""

from __future__ import annotations

import torch

from ninfer.models.kv_cache import KVCache


def _runs(host_pages: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first host page, offset in the list, length) of each run of consecutive host pages."""
    runs: list[tuple[int, int, int]] = []
    for offset, page in enumerate(host_pages):
        if runs and page == runs[-1][0] + runs[-1][2]:
            first, start, length = runs[-1]
            runs[-1] = (first, start, length + 1)
        else:
            runs.append((page, offset, 1))
    return runs


class HostKV:
    def __init__(self, kv: KVCache, num_pages: int):
        self.kv = kv
        self.num_pages = num_pages
        pin = kv.k.is_cuda
        # Keys and values may be in different formats (--kv-dtype k8v4): each keeps its own row width.
        self.k = torch.empty((num_pages, *kv.k[:, 0].shape), dtype=kv.k.dtype, pin_memory=pin)
        self.v = torch.empty((num_pages, *kv.v[:, 0].shape), dtype=kv.v.dtype, pin_memory=pin)

    @staticmethod
    def page_bytes(kv: KVCache) -> int:
        return kv.page_bytes

    def spill(self, device_pages: tuple[int, ...], host_pages: tuple[int, ...]) -> None:
        index = torch.tensor(device_pages, dtype=torch.long, device=self.kv.k.device)
        for device_store, host_store in ((self.kv.k, self.k), (self.kv.v, self.v)):
            staged = device_store.index_select(1, index).transpose(0, 1).contiguous()  # [n, layers, ...]
            for first, start, length in _runs(host_pages):
                host_store[first : first + length].copy_(staged[start : start + length], non_blocking=True)

    def restore(self, host_pages: tuple[int, ...], device_pages: tuple[int, ...]) -> None:
        device = self.kv.k.device
        index = torch.tensor(device_pages, dtype=torch.long, device=device)
        for device_store, host_store in ((self.kv.k, self.k), (self.kv.v, self.v)):
            parts = [
                host_store[first : first + length].to(device, non_blocking=True)
                for first, _, length in _runs(host_pages)
            ]
            staged = torch.cat(parts) if len(parts) > 1 else parts[0]  # [n, layers, ...]
            device_store.index_copy_(1, index, staged.transpose(0, 1))
