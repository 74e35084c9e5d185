"""CandidateSelector: DFlash2's rescoring of the draft's top candidates by their transitions.

At block position t the draft keeps its top selector_top_k tokens; candidate b following the
token a chosen before it scores S_t(a, b) = U_t(b) + <A(a) * P(h_t), B(b)>, where U is the
draft's own logit, A and B rank-r predecessor and successor codebooks over the vocabulary and
P a projection of position t's hidden state. The walk over these scores (greedy or sampled)
is the drafter's; this module only scores.
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer.models.layers.linear import Linear


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        # Stored as bare tensors (`candidate_selector.predecessor_codebook`), rows by token id.
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = Linear(hidden_size, rank, bias=False)

    def scores(
        self, unary: torch.Tensor, candidate_ids: torch.Tensor, predecessor_ids: torch.Tensor, projected: torch.Tensor
    ) -> torch.Tensor:
        """unary [N, C] fp32 logits of candidate_ids [N, C]; predecessor_ids [N]; projected [N, r]
        (hidden_projection of the position's hidden) -> S [N, C] fp32."""
        context = self.predecessor_codebook[predecessor_ids].float() * projected.float()
        successors = self.successor_codebook[candidate_ids].float()
        return unary + torch.einsum("nr,ncr->nc", context, successors)
