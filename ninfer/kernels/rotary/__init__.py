import torch

from ninfer.kernels.backend import fast_impl
from ninfer.kernels.rotary import ref


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    impl = fast_impl(__name__, "apply_rotary", q) or ref.apply_rotary
    return impl(q, k, cos, sin)
