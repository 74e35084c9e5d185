"""Swap a model's nn.Linear layers for quantized or half-precision modules, in place."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def replace_linear_layers(
    model: nn.Module,
    skip: tuple[str, ...],
    convert: Callable[[nn.Linear], nn.Module],
    accept: Callable[[nn.Linear], bool] = lambda linear: True,
) -> int:
    """Replace each nn.Linear that `accept`s by convert(linear), except those whose name is or
    ends in one of `skip` (whole dotted components: "mlp.gate" is not "mlp.gate_proj");
    returns how many."""
    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if not isinstance(child, nn.Linear) or any(full == s or full.endswith("." + s) for s in skip):
                continue
            if accept(child):
                setattr(parent, child_name, convert(child))
                replaced += 1
    return replaced
