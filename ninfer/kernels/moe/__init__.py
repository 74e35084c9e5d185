import torch

from ninfer.kernels.backend import fast_impl
from ninfer.kernels.moe import ref


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    impl = fast_impl(__name__, "route", router_logits) or ref.route
    return impl(router_logits, top_k, renormalize)


def fused_experts(x, weights, expert_ids, gate_up_proj, down_proj) -> torch.Tensor:
    impl = fast_impl(__name__, "fused_experts", x) or ref.fused_experts
    return impl(x, weights, expert_ids, gate_up_proj, down_proj)
