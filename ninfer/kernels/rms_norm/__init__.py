import torch

from ninfer.kernels.backend import fast_impl
from ninfer.kernels.rms_norm import ref


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    impl = fast_impl(__name__, "rms_norm", x) or ref.rms_norm
    return impl(x, weight, eps, zero_centered)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = fast_impl(__name__, "add_rms_norm", x) or ref.add_rms_norm
    return impl(x, residual, weight, eps, zero_centered)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    impl = fast_impl(__name__, "gated_rms_norm", x) or ref.gated_rms_norm
    return impl(x, gate, weight, eps)
