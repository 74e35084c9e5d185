import torch

from ninfer.kernels.backend import fast_impl
from ninfer.kernels.paged_attention import ref


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    impl = fast_impl(__name__, "store_kv", k) or ref.store_kv
    impl(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_lens: tuple[int, ...],
    seq_lens: tuple[int, ...],
    scale: float,
) -> torch.Tensor:
    impl = fast_impl(__name__, "paged_attention", q) or ref.paged_attention
    return impl(q, k_cache, v_cache, page_table, query_lens, seq_lens, scale)
