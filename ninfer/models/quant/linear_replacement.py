"""Swap a model's nn.Linear layers (or other modules, e.g. MoE experts) for quantized or half-precision
modules, in place."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ninfer.kernels.activation import silu_and_mul
from ninfer.kernels.gemv import conv_first_columns


class UnfusedEpilogues:
    """The epilogues models ask of a packed projection, for modules whose product has no fused
    version of them: the product, then the epilogue."""

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a packed gate | up projection."""
        return silu_and_mul(self.forward(x))

    def forward_causal_conv1d_update(
        self, x: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor
    ) -> torch.Tensor:
        """The product of one decode token per request with the conv's decode step on its
        first conv_weight.shape[0] columns."""
        return conv_first_columns(self.forward(x), conv_weight, conv_state, state_slots)


def replace_linear_layers(
    model: nn.Module,
    skip: tuple[str, ...],
    convert: Callable[[nn.Linear], nn.Module],
    accept: Callable[[nn.Linear], bool] = lambda linear: True,
) -> int:
    """Replace each nn.Linear that `accept`s by convert(linear), except those whose name is or
    ends in one of `skip` (whole dotted components: "mlp.gate" is not "mlp.gate_proj");
    returns how many."""
    return replace_modules(model, nn.Linear, skip, convert, accept)


def replace_modules(
    model: nn.Module,
    kind: type[nn.Module],
    skip: tuple[str, ...],
    convert: Callable[[nn.Module], nn.Module],
    accept: Callable[[nn.Module], bool] = lambda module: True,
) -> int:
    """replace_linear_layers for modules of any `kind` (e.g. fused MoE experts)."""
    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if not isinstance(child, kind) or any(full == s or full.endswith("." + s) for s in skip):
                continue
            if accept(child):
                setattr(parent, child_name, convert(child))
                replaced += 1
    return replaced
