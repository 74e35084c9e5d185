"""Attention: GQA self-attention over the paged KV cache.

One module covers Llama/Qwen2 (optional q/k/v bias), Qwen3 (per-head q/k RMSNorm) and
the Qwen3.5/Qwen3-Next gated form (q_proj rows interleave [query_h | gate_h] per head,
sigmoid(gate) scales the attention output before o_proj, zero-centred q/k norms).
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer.kernels.activation import sigmoid_mul
from ninfer.kernels.attention_prep import prepare_qkv
from ninfer.kernels.paged_attention import paged_attention
from ninfer.models.config import ModelConfig
from ninfer.models.forward_batch import ForwardBatch
from ninfer.models.layers.linear import Linear, PackedLinear
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
        kv_rows = self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(config.hidden_size, {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}, bias)
        self.qkv_sizes = self.qkv_proj.part_sizes  # kept here: quantization may replace the Linear
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_output_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.zero_centered_norm)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.zero_centered_norm)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        gate = None
        if self.output_gate:
            q, gate = q.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        norm = self.q_norm is not None
        k_cache, v_cache = batch.kv_cache.layer(self.kv_layer_index)
        q = prepare_qkv(
            q,
            k,
            v,
            self.q_norm.weight if norm else None,
            self.k_norm.weight if norm else None,
            self.q_norm.eps if norm else 0.0,
            self.q_norm.zero_centered if norm else False,
            cos,
            sin,
            k_cache,
            v_cache,
            batch.slot_mapping,
        )
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
            prefetch_kv=True,  # prepare_qkv, launched just before, writes only the new keys
            # A padded step's max_query_len is its bucket: decode rows beside a prompt get their own split launch.
            split_short_requests=batch.padded is not None,
        )
        if gate is not None:
            out = sigmoid_mul(out, gate)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
