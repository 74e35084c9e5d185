"""KVCache: paged key/value storage for every full-attention layer of one model.

Page p of attention layer l holds page_size consecutive tokens of one sequence:
k[l, p, i] is the key of the token at offset p_index * page_size + i. Allocation,
refcounts and sharing live in the engine's KV pool; this is only the storage.

Keys and values are plain (the model's dtype) or quantized, each in its own format
(kernels/kv_quant: a row of codes and scales per token and head, the tensor's dtype naming
the format), so pages move as whole rows of bytes whatever they hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.kernels.kv_quant import STORAGE_DTYPES, row_bytes

# --kv-dtype -> (key format, value format); None: plain values in the model's dtype.
KV_DTYPES: dict[str, tuple[str | None, str | None]] = {
    "bf16": (None, None),
    "int8": ("int8", "int8"),
    "fp8": ("fp8", "fp8"),
    "nvfp4": ("nvfp4", "nvfp4"),
    "k8v4": ("int8", "nvfp4"),
}


@dataclass
class KVCache:
    k: torch.Tensor  # [num_layers, num_pages, page_size, num_kv_heads, head_dim or a quantized row's bytes]
    v: torch.Tensor  # the same, in the value format's row width

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
        kv_dtype: str = "bf16",
    ) -> KVCache:
        """dtype: that of plain rows; kv_dtype: a KV_DTYPES name."""

        def storage(fmt: str | None) -> torch.Tensor:
            width = head_dim if fmt is None else row_bytes(fmt, head_dim)
            shape = (num_layers, num_pages, page_size, num_kv_heads, width)
            return torch.zeros(shape, dtype=dtype if fmt is None else STORAGE_DTYPES[fmt], device=device)

        k_format, v_format = KV_DTYPES[kv_dtype]
        return cls(storage(k_format), storage(v_format))

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    def layer(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_index], self.v[layer_index]

    @property
    def page_bytes(self) -> int:
        """One page of every layer, keys and values."""
        return sum(store[:, 0].numel() * store.element_size() for store in (self.k, self.v))

    @property
    def nbytes(self) -> int:
        return sum(store.numel() * store.element_size() for store in (self.k, self.v))

    @property
    def bytes_per_token(self) -> int:
        return self.page_bytes // self.page_size


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, element_size: int, kv_dtype: str = "bf16"
) -> int:
    """Bytes one token takes in a KVCache of these dimensions, keys and values."""
    return sum(
        num_layers * num_kv_heads * (head_dim * element_size if fmt is None else row_bytes(fmt, head_dim))
        for fmt in KV_DTYPES[kv_dtype]
    )
