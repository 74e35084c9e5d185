import torch

from ninfer.kernels.backend import fast_impl
from ninfer.kernels.gated_delta_rule import ref


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = fast_impl(__name__, "gdn_gates", a) or ref.gdn_gates
    return impl(a, b, A_log, dt_bias)


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


def recurrent_gated_delta_rule_with_gates(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    query_lens: tuple[int, ...],
) -> torch.Tensor:
    """Decode form taking the raw gate projections: one launch for gates and rule."""
    impl = fast_impl(__name__, "recurrent_gated_delta_rule_with_gates", q) or ref.recurrent_gated_delta_rule_with_gates
    return impl(q, k, v, a, b, A_log, dt_bias, state, state_slots, query_lens)
