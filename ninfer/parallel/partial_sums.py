"""The all-reduces of a tensor-parallel rank's model: where its row-parallel layers leave partial sums.

Each token mixer (attention, Gated DeltaNet) ends in a row-parallel projection and each MLP in
one, so a rank's output of such a block is its heads' (or intermediate columns') share of the
sum; one all-reduce after the block makes it whole on every rank. An MoE block is reduced once
as a whole: its routed experts and its shared expert each leave a partial sum, and the shared
expert's sigmoid gate scales it linearly, so their sum is the block's partial sum. Forward hooks
keep the model files plain and reach every path the block takes (the fused MoE kernels too).
"""

from __future__ import annotations

from torch import nn

from ninfer.models.layers.attention import Attention
from ninfer.models.layers.gated_deltanet import GatedDeltaNet
from ninfer.models.layers.mlp import MLP
from ninfer.models.layers.moe import SparseMoE
from ninfer.parallel.group import RankGroup


def reduce_partial_sums(model: nn.Module, group: RankGroup) -> int:
    """Sum each partial-sum block's output over the ranks, in place after its forward; -> blocks hooked."""
    shared_experts = {id(m.shared_expert) for m in model.modules() if isinstance(m, SparseMoE)}
    blocks = [
        m for m in model.modules()
        if isinstance(m, (Attention, GatedDeltaNet, SparseMoE)) or (isinstance(m, MLP) and id(m) not in shared_experts)
    ]  # fmt: skip
    for block in blocks:
        block.register_forward_hook(lambda _module, _inputs, output: group.all_reduce(output))
    return len(blocks)
