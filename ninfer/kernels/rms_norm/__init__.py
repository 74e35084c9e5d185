import torch

from ninfer.kernels.backend import fast_impl
from ninfer.kernels.rms_norm import ref


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    impl = fast_impl(__name__, "rms_norm", x) or ref.rms_norm
    return impl(x, weight, eps, zero_centered)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool = False,
    *,
    early_residual: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """early_residual: a launch hint for the fast path (see its docstring); same result."""
    impl = fast_impl(__name__, "add_rms_norm", x)
    if impl is None:
        return ref.add_rms_norm(x, residual, weight, eps, zero_centered)
    return impl(x, residual, weight, eps, zero_centered, early_residual=early_residual)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *, early_gate: bool = False
) -> torch.Tensor:
    """early_gate: a launch hint for the fast path (see its docstring); same result."""
    impl = fast_impl(__name__, "gated_rms_norm", x)
    if impl is None:
        return ref.gated_rms_norm(x, gate, weight, eps)
    return impl(x, gate, weight, eps, early_gate=early_gate)
