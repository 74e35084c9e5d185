import torch

from ninfer.kernels.backend import fast_impl
from ninfer.kernels.causal_conv1d import ref


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_lens: tuple[int, ...],
    split: tuple[int, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    impl = fast_impl(__name__, "causal_conv1d", x) or ref.causal_conv1d
    return impl(x, weight, conv_state, state_slots, query_lens, split)


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor
) -> torch.Tensor:
    impl = fast_impl(__name__, "causal_conv1d_update", x) or ref.causal_conv1d_update
    return impl(x, weight, conv_state, state_slots)
