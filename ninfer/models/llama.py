"""Plain attention decoders: Llama, Qwen2 (q/k/v bias), Qwen3 (q/k norm) and Qwen3-MoE.

Every layer is full attention over the paged KV cache, so the model never touches the
state cache. Parameter names follow the HF checkpoints (`model.layers.{i}.self_attn.q_proj`,
`model.layers.{i}.mlp.experts.gate_up_proj` ...), so the checkpoint rule stays a renaming.
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer.models.causal_lm import CausalLM
from ninfer.models.config import ModelConfig
from ninfer.models.forward_batch import ForwardBatch
from ninfer.models.layers.attention import Attention
from ninfer.models.layers.linear import Linear
from ninfer.models.layers.mlp import MLP
from ninfer.models.layers.moe import SparseMoE
from ninfer.models.layers.norm import RMSNorm
from ninfer.models.layers.rotary import RotaryEmbedding


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(config, kv_layer_index=layer_id)
        self.mlp: nn.Module
        if config.layer_is_moe(layer_id):
            self.mlp = SparseMoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as Qwen3_5DecoderLayer: (output, residual before it); the next norm adds them."""
        if residual is None:
            h, residual = self.input_layernorm(hidden), hidden
        else:
            h, residual = self.input_layernorm.add_forward(hidden, residual)
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn(h, cos, sin, batch), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(batch.positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, batch)
        return self.norm.add_forward(hidden, residual)[0]


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, batch)
