"""MultiTokenPredictor: Qwen3.5 / Qwen3-Next MTP head (checkpoint prefix `mtp.`).

Predicts token t+2 from the target's final-normed hidden state h_t and the embedding of
token t+1: x = fc([pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]) (embedding first),
then one full-attention decoder layer with its own KV layer at the same positions, then norm.
With several MTP layers, draft step s uses layer s % num_layers (as vLLM / SGLang run them).
The embedding and lm_head are the target's, so they are not stored here.
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer.models.config import ModelConfig
from ninfer.models.forward_batch import ForwardBatch
from ninfer.models.layers.linear import Linear
from ninfer.models.layers.norm import RMSNorm


class MultiTokenPredictor(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[nn.Module]):
        """layers: the model family's full-attention decoder layers (mtp.layers.{i}), built by the caller."""
        super().__init__()
        hidden = config.hidden_size
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(hidden, config.rms_norm_eps, config.zero_centered_norm)
        self.pre_fc_norm_hidden = RMSNorm(hidden, config.rms_norm_eps, config.zero_centered_norm)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, config.rms_norm_eps, config.zero_centered_norm)

    def forward(
        self,
        next_embeds: torch.Tensor,
        target_hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        step_index: int = 0,
    ) -> torch.Tensor:
        """next_embeds, target_hidden: [T, H] -> final-normed hidden [T, H] for the shared lm_head.

        step_index: which draft step this is (0 for the first token after the target).
        """
        normed = (self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(target_hidden))
        x = self.fc(torch.cat(normed, dim=-1))
        x, residual = self.layers[step_index % len(self.layers)](x, None, cos, sin, batch)
        return self.norm.add_forward(x, residual)[0]
