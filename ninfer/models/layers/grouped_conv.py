"""GroupedDynamicConv: DFlash2's grouped dynamic depthwise convolution around a sublayer.

Along each drafting block, out_t = sum over taps j of (w_j + d_{t,j}) * x_{t-j}: w a static
per-channel kernel, d a content-adaptive delta shared by each group of conv_group_size channels.
One module wraps one sublayer (attention or MLP): both deltas, for the convolution before it and
the one after it, are projected from the sublayer's normed input. Taps reach back within the
block only (x before a block's first row reads zero), so rows of different requests never mix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.models.layers.linear import Linear


class GroupedDynamicConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} does not divide hidden size {hidden_size}")
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [before/after, tap, channel]
        self.kernel_projection = Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)

    def prepare(self, x: torch.Tensor, block_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R * block_len, H], the sublayer's input -> (x convolved for the sublayer, the deltas
        of the convolution after it)."""
        deltas = self.kernel_projection(x).view(-1, 2, self.kernel_size, self.num_groups)
        return self._convolve(x, deltas[:, 0], 0, block_len), deltas[:, 1]

    def finish(self, x: torch.Tensor, deltas: torch.Tensor, block_len: int) -> torch.Tensor:
        """The sublayer's output [R * block_len, H] convolved with prepare()'s second deltas."""
        return self._convolve(x, deltas, 1, block_len)

    def _convolve(self, x: torch.Tensor, deltas: torch.Tensor, side: int, block_len: int) -> torch.Tensor:
        rows = x.view(-1, block_len, self.num_groups, self.group_size)
        # [R, block_len, taps, groups, group_size]: the static kernel plus each group's delta.
        kernel = self.base_kernel[side].view(self.kernel_size, self.num_groups, self.group_size).to(x.dtype)
        kernel = kernel + deltas.view(*rows.shape[:2], self.kernel_size, self.num_groups, 1)
        out = kernel[:, :, 0] * rows
        for tap in range(1, self.kernel_size):
            earlier = F.pad(rows[:, :-tap], (0, 0, 0, 0, tap, 0))  # row t reads row t - tap of its block
            out = out + kernel[:, :, tap] * earlier
        return out.view_as(x)
