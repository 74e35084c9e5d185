"""Qwen3.5 / 3.6 / 3.8 hybrid text model (dense and MoE): Gated DeltaNet + gated attention, MTP head.

Layer i mixes tokens with GatedDeltaNet (layer_types "linear_attention", state in a state
slot) or gated full attention (paged KV), then a SwiGLU MLP or routed MoE; every norm is the
zero-centred (1 + w) RMSNorm. The vision tower is not part of this module.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ninfer.models.causal_lm import CacheSpec, CausalLM
from ninfer.models.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from ninfer.models.forward_batch import ForwardBatch
from ninfer.models.layers.attention import Attention
from ninfer.models.layers.gated_deltanet import GatedDeltaNet
from ninfer.models.layers.linear import Linear
from ninfer.models.layers.mlp import MLP
from ninfer.models.layers.moe import SparseMoE
from ninfer.models.layers.mtp import MultiTokenPredictor
from ninfer.models.layers.norm import RMSNorm
from ninfer.models.layers.rotary import RotaryEmbedding


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, cache_layer_index: int, moe: bool):
        """cache_layer_index: the layer's index among KV layers (attention) or state layers (GDN)."""
        super().__init__()
        self.layer_type = layer_type
        if layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config, cache_layer_index)
        else:
            self.self_attn = Attention(config, cache_layer_index)
        self.mlp = SparseMoE(config) if moe else MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered_norm)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, residual: the stream before it (None at the first layer).

        Returns (this layer's output, the residual stream before it): adding the two is left
        to the next norm, which does it in the same pass.
        """
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        if self.layer_type == LINEAR_ATTENTION:
            h = self.linear_attn(h, batch)
        else:
            h = self.self_attn(h, cos, sin, batch)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class Qwen3_5Model(nn.Module):
    """The text trunk (checkpoint prefix `model.`, or `model.language_model.` in VLM checkpoints)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers = []
        num_attention_layers = num_linear_layers = 0
        for layer_id, layer_type in enumerate(config.layer_types):
            if layer_type == LINEAR_ATTENTION:
                cache_layer_index, num_linear_layers = num_linear_layers, num_linear_layers + 1
            else:
                cache_layer_index, num_attention_layers = num_attention_layers, num_attention_layers + 1
            layers.append(Qwen3_5DecoderLayer(config, layer_type, cache_layer_index, config.layer_is_moe(layer_id)))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered_norm)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if batch.media_rows is not None:
            x = x.index_copy(0, batch.media_rows, batch.media_embeds.to(x.dtype))
        cos, sin = self.rotary_emb(batch.positions, x.dtype)
        residual = None
        aux, aux_ids, last = batch.aux_hidden, batch.aux_layer_ids, len(self.layers) - 1
        for layer_id, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, batch)
            if aux is not None and layer_id in aux_ids and layer_id != last:
                # The residual stream after this layer: the sum the next norm would form.
                aux[:, aux_ids.index(layer_id)] = x + residual
        hidden = self.norm.add_forward(x, residual)[0]
        if aux is not None and last in aux_ids:
            aux[:, aux_ids.index(last)] = hidden  # after the last layer, final-normed (as transformers reports it)
        return hidden


class Qwen3_5ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Qwen3_5Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp: MultiTokenPredictor | None = None
        if config.mtp_num_hidden_layers:
            # The MTP layers' KV follows the trunk's attention layers in the same KVCache.
            first_kv_layer = len(config.attention_layer_ids)
            mtp_layers = [
                Qwen3_5DecoderLayer(config, FULL_ATTENTION, first_kv_layer + i, config.is_moe)
                for i in range(config.mtp_num_hidden_layers)
            ]
            self.mtp = MultiTokenPredictor(config, mtp_layers)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, batch)

    def forward_mtp(
        self,
        next_input_ids: torch.Tensor,
        target_hidden: torch.Tensor,
        batch: ForwardBatch,
        step_index: int = 0,
    ) -> torch.Tensor:
        """Row t: token t+1 and the hidden at t -> MTP hidden [T, H] (feed compute_logits).

        target_hidden is the target's final-normed hidden (or, for later draft steps, the
        previous MTP output); batch describes the same positions as that step, and the MTP
        layer's KV is written at them.
        """
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP head (mtp_num_hidden_layers == 0)")
        embeds = self.model.embed_tokens(next_input_ids)
        cos, sin = self.model.rotary_emb(batch.positions, embeds.dtype)
        return self.mtp(embeds, target_hidden, cos, sin, batch, step_index)

    def cache_spec(self) -> CacheSpec:
        spec = super().cache_spec()
        if not self.config.mtp_num_hidden_layers:
            return spec
        return dataclasses.replace(
            spec, num_attention_layers=spec.num_attention_layers + self.config.mtp_num_hidden_layers
        )
