"""Linear layers of our models: decode-sized batches run the weight-streaming GEMV kernel.

PackedLinear stores projections of the same input as one matrix, so decode runs one GEMV.
Checkpoints store the parts separately (`gate_proj`, `up_proj`, ...); the loader writes
each part's rows of the packed weight (see `packed_parts`), so checkpoint rules and the
names clients see stay those of the checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer.kernels.gemv import linear, linear_causal_conv1d_update, linear_silu_and_mul


class Linear(nn.Linear):
    """nn.Linear whose product is chosen by ninfer.kernels.gemv.linear (GEMV kernel at decode sizes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False):
        """parts: each stored projection's name (a sibling of this module) and its output rows, in order."""
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)

    @property
    def part_sizes(self) -> list[int]:
        return list(self.parts.values())

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for a gate | up pair of equal parts (decode: one launch)."""
        return linear_silu_and_mul(x, self.weight, self.bias)

    def forward_causal_conv1d_update(
        self, x: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor
    ) -> torch.Tensor:
        """The product of one decode token per request with the conv's decode step on its
        first conv_weight.shape[0] columns (decode: one launch)."""
        return linear_causal_conv1d_update(x, self.weight, self.bias, conv_weight, conv_state, state_slots)


def packed_parts(model: nn.Module) -> dict[str, tuple[str, slice]]:
    """Stored parameter name -> (packed parameter name, its rows) for every PackedLinear in `model`."""
    table: dict[str, tuple[str, slice]] = {}
    for module_name, module in model.named_modules():
        parts = getattr(module, "parts", None)  # a PackedLinear, or a quantized module that replaced one
        if not parts:
            continue
        parent = module_name.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        start = 0
        for part, num_rows in parts.items():
            rows = slice(start, start + num_rows)
            start += num_rows
            table[f"{prefix}{part}.weight"] = (f"{module_name}.weight", rows)
            if module.bias is not None:
                table[f"{prefix}{part}.bias"] = (f"{module_name}.bias", rows)
    return table


def rows_within(part_rows: slice, index: object) -> slice:
    """Compose a checkpoint rule's row slice of a part with the part's rows in the packed weight."""
    if index is None:
        return part_rows
    if not isinstance(index, slice) or index.step not in (None, 1):
        raise ValueError(f"a packed projection takes whole parts or row slices of them, not {index!r}")
    size = part_rows.stop - part_rows.start
    start, stop, _ = index.indices(size)
    return slice(part_rows.start + start, part_rows.start + stop)
