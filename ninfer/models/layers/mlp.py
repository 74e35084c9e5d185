"""SwiGLU feed-forward block (gate and up projections packed into one matrix)."""

import torch
from torch import nn

from ninfer.models.layers.linear import Linear, PackedLinear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The activation rides in gate_up's GEMV epilogue at decode sizes (one launch fewer).
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))
