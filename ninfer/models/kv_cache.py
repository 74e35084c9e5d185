"""KVCache: paged key/value storage for every full-attention layer of one model.

Page p of attention layer l holds page_size consecutive tokens of one sequence:
k[l, p, i] is the key of the token at offset p_index * page_size + i. Allocation,
refcounts and sharing live in the engine's KV pool; this is only the storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    k: torch.Tensor  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v: torch.Tensor  # same shape as k

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    def layer(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_index], self.v[layer_index]

    @property
    def bytes_per_token(self) -> int:
        num_layers, _, _, heads, dim = self.k.shape
        return 2 * num_layers * heads * dim * self.k.element_size()
