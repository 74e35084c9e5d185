"""Attention: GQA self-attention over the paged KV cache.

One module covers Llama/Qwen2 (optional q/k/v bias), Qwen3 (per-head q/k RMSNorm) and
the Qwen3.5/Qwen3-Next gated form (q_proj rows interleave [query_h | gate_h] per head,
sigmoid(gate) scales the attention output before o_proj, zero-centred q/k norms).
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer.kernels.paged_attention import paged_attention, store_kv
from ninfer.kernels.rotary import apply_rotary
from ninfer.models.config import ModelConfig
from ninfer.models.forward_batch import ForwardBatch
from ninfer.models.layers.norm import RMSNorm


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, kv_layer_index: int):
        super().__init__()
        self.kv_layer_index = kv_layer_index  # index among the model's attention layers in the KV cache
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.output_gate = config.attn_output_gate
        q_rows = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_rows, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_output_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.zero_centered_norm)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.zero_centered_norm)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x)
        gate = None
        if self.output_gate:
            q, gate = q.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(num_tokens, self.num_heads * self.head_dim)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, cos, sin)

        k_cache, v_cache = batch.kv_cache.layer(self.kv_layer_index)
        store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = paged_attention(
            q,
            k_cache,
            v_cache,
            batch.page_table,
            batch.query_start_loc,
            batch.seq_lens,
            self.scale,
            max_query_len=batch.max_query_len,
            query_lens_cpu=batch.query_lens_cpu,
            seq_lens_cpu=batch.seq_lens_cpu,
        ).reshape(num_tokens, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)
