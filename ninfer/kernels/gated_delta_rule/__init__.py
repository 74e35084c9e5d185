import torch

from ninfer.kernels.backend import fast_impl
from ninfer.kernels.gated_delta_rule import ref


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    query_lens: tuple[int, ...],
) -> torch.Tensor:
    impl = fast_impl(__name__, "chunk_gated_delta_rule", q) or ref.chunk_gated_delta_rule
    return impl(q, k, v, g, beta, state, state_slots, query_lens)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    query_lens: tuple[int, ...],
) -> torch.Tensor:
    impl = fast_impl(__name__, "recurrent_gated_delta_rule", q) or ref.recurrent_gated_delta_rule
    return impl(q, k, v, g, beta, state, state_slots, query_lens)
