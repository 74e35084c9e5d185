"""DFlash / DFlash2 drafter: a few Qwen3-style decoder layers that draft a whole block at once.

The drafter has no embedding or lm_head of its own; it uses the target's. Its context is the
target's residual streams after the layers in target_layer_ids, concatenated per token and
mapped by `fc` and `hidden_norm`; every drafter layer projects that context with its own k_proj
and v_proj (k_norm, RoPE at the token's position) into the drafter's paged KV ("KV injection"),
once per computed token. A block is [the last committed token, mask tokens...] at the positions
that follow the context: its queries attend to the context and to the block's own keys (the
whole block, or causally, per layer), so one forward yields a hidden state for every mask row.
The block's K/V are written at their positions too, which the next step's context rewrites
before any later block reads them.

DFlash2 wraps each attention and MLP sublayer in a grouped dynamic convolution along the block
(layers/grouped_conv.py) and adds the candidate selector (layers/candidate_selector.py).
Loading lives in draft_loader.py; the attention metadata of a step's blocks in DraftBlock.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.kernels.attention_prep import prepare_qkv
from ninfer.kernels.paged_attention import paged_attention
from ninfer.models.draft_config import DraftConfig
from ninfer.models.kv_cache import KVCache
from ninfer.models.layers.candidate_selector import CandidateSelector
from ninfer.models.layers.grouped_conv import GroupedDynamicConv
from ninfer.models.layers.linear import Linear, PackedLinear
from ninfer.models.layers.mlp import MLP
from ninfer.models.layers.norm import RMSNorm
from ninfer.models.layers.rotary import RotaryEmbedding


@dataclass
class DraftBlock:
    """One step's drafting blocks: R requests of block_len rows each, request r's at positions
    starts[r] .. starts[r] + block_len - 1 (rows past its reserved positions write to the last one).

    Full-attention layers run the paged attention with every block row as a one-query sequence
    whose length says which keys it sees: the whole block (block_lens) or up to itself
    (causal_lens). Everything is computed on the device from device tensors; the host copies of
    the lengths serve the CPU attention only."""

    block_len: int
    starts: torch.Tensor  # [R] int64
    limits: torch.Tensor  # [R] int64: positions reserved per request
    page_table: torch.Tensor  # [R, max_pages] int32
    positions: torch.Tensor  # [R * block_len] int64
    rope_positions: torch.Tensor  # [R * block_len] int64: positions plus the request's rope offset (media)
    slot_mapping: torch.Tensor  # [R * block_len] int64: where each row's K/V are written
    row_page_table: torch.Tensor  # [R * block_len, max_pages] int32
    row_starts: torch.Tensor  # [R * block_len + 1] int32: one query per row
    block_lens: torch.Tensor  # [R * block_len] int32
    causal_lens: torch.Tensor  # [R * block_len] int32
    block_lens_cpu: tuple[int, ...]
    causal_lens_cpu: tuple[int, ...]

    @classmethod
    def build(
        cls, starts: torch.Tensor, limits: torch.Tensor, page_table: torch.Tensor, block_len: int, page_size: int,
        rope_offsets: torch.Tensor | None = None,
    ) -> DraftBlock:
        """rope_offsets [R]: what a target request with media adds to its decoded tokens' index for
        RoPE (its context rows are stored at the target's rotary positions)."""
        num_rows = starts.shape[0] * block_len
        device = starts.device
        positions = starts[:, None] + torch.arange(block_len, device=device)
        stored = torch.minimum(positions, (limits - 1)[:, None])
        pages = page_table.gather(1, stored // page_size).to(torch.int64)
        block_lens = torch.minimum(starts + block_len, limits).repeat_interleave(block_len).to(torch.int32)
        causal_lens = (stored + 1).view(-1).to(torch.int32)
        on_cpu = device.type == "cpu"  # the CPU attention loops over host lengths; the fast kernels read these
        return cls(
            block_len=block_len,
            starts=starts,
            limits=limits,
            page_table=page_table,
            positions=positions.view(-1),
            rope_positions=(positions if rope_offsets is None else positions + rope_offsets[:, None]).view(-1),
            slot_mapping=(pages * page_size + stored % page_size).view(-1),
            row_page_table=page_table.repeat_interleave(block_len, dim=0),
            row_starts=torch.arange(num_rows + 1, dtype=torch.int32, device=device),
            block_lens=block_lens,
            causal_lens=causal_lens,
            block_lens_cpu=tuple(block_lens.tolist()) if on_cpu else (1,) * num_rows,
            causal_lens_cpu=tuple(causal_lens.tolist()) if on_cpu else (1,) * num_rows,
        )

    @property
    def num_requests(self) -> int:
        return self.starts.shape[0]


def window_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block: DraftBlock, window: int, causal: bool,
    scale: float,
) -> torch.Tensor:
    """A sliding-window layer: block row at position p sees keys k with p - k < window (and k <= p
    when causal, k - p < window otherwise). The window + block_len - 1 positions ending at the
    block's last row cover every row's keys, so they are gathered from the pages at a fixed
    shape. q [R * block_len, Hq, D] -> [R * block_len, Hq, D]."""
    num_requests, block_len = block.num_requests, block.block_len
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    span = window + block_len - 1
    key_pos = block.starts[:, None] + block_len - span + torch.arange(span, device=q.device)  # [R, span]
    stored = torch.minimum(key_pos.clamp_min(0), (block.limits - 1)[:, None])
    slots = block.page_table.gather(1, stored // page_size).to(torch.int64) * page_size + stored % page_size
    keys = k_cache.view(-1, num_kv_heads, head_dim)[slots]  # [R, span, Hk, D]
    values = v_cache.view(-1, num_kv_heads, head_dim)[slots]
    distance = block.positions.view(num_requests, block_len, 1) - key_pos[:, None, :]  # query - key
    visible = (key_pos >= 0)[:, None, :] & (distance < window) & ((distance >= 0) if causal else (distance > -window))
    out = F.scaled_dot_product_attention(
        q.view(num_requests, block_len, -1, head_dim).transpose(1, 2).float(),
        keys.transpose(1, 2).float(),
        values.transpose(1, 2).float(),
        attn_mask=visible[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2).reshape(q.shape).to(q.dtype)


class DflashAttention(nn.Module):
    """Qwen3 attention (per-head q/k RMSNorm, RoPE, no output gate) over the drafter's paged KV."""

    def __init__(self, config: DraftConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index  # the layer's index in the drafter's KV cache
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.causal = config.layer_causal[layer_index]
        self.window = config.layer_windows[layer_index]
        hidden, bias = config.hidden_size, config.attention_bias
        kv_rows = self.num_kv_heads * self.head_dim
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        # k and v apart from q: the context rows need only these.
        self.kv_proj = PackedLinear(hidden, {"k_proj": kv_rows, "v_proj": kv_rows}, bias)
        self.kv_sizes = self.kv_proj.part_sizes  # kept here: quantization may replace the Linear
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv_proj(x).split(self.kv_sizes, dim=-1)
        shape = (x.shape[0], self.num_kv_heads, self.head_dim)
        return k.view(shape), v.view(shape)

    def store_context(
        self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
    ) -> None:
        """Write the context rows' K/V [T, H] at slot_mapping."""
        k, v = self._keys_values(context)
        k_cache, v_cache = kv_cache.layer(self.layer_index)
        # The context has no queries: its keys stand in for them in the fused prep (that copy is dropped).
        prepare_qkv(k, k, v, self.k_norm.weight, self.k_norm.weight, self.k_norm.eps, False, cos, sin,
                    k_cache, v_cache, slot_mapping)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, block: DraftBlock, kv_cache: KVCache
    ) -> torch.Tensor:
        num_rows = x.shape[0]
        q = self.q_proj(x).view(num_rows, self.num_heads, self.head_dim)
        k, v = self._keys_values(x)
        k_cache, v_cache = kv_cache.layer(self.layer_index)
        q = prepare_qkv(q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, False, cos, sin,
                        k_cache, v_cache, block.slot_mapping)
        if self.window is not None:
            out = window_attention(q, k_cache, v_cache, block, self.window, self.causal, self.scale)
        else:
            lens, lens_cpu = (
                (block.causal_lens, block.causal_lens_cpu) if self.causal else (block.block_lens, block.block_lens_cpu)
            )
            out = paged_attention(
                q, k_cache, v_cache, block.row_page_table, block.row_starts, lens, self.scale,
                max_query_len=1, query_lens_cpu=(1,) * num_rows, seq_lens_cpu=lens_cpu,
            )
        return self.o_proj(out.reshape(num_rows, self.num_heads * self.head_dim))


class DflashDecoderLayer(nn.Module):
    def __init__(self, config: DraftConfig, layer_index: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = DflashAttention(config, layer_index)
        self.mlp = MLP(hidden, config.intermediate_size)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.attention_conv: GroupedDynamicConv | None = None
        self.mlp_conv: GroupedDynamicConv | None = None
        if config.is_dflash2:
            self.attention_conv = GroupedDynamicConv(hidden, config.conv_kernel_size, config.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(hidden, config.conv_kernel_size, config.conv_group_size)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        block: DraftBlock,
        kv_cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it), as the target's decoder layers."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self._convolved(self.attention_conv, lambda h: self.self_attn(h, cos, sin, block, kv_cache), h, block)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self._convolved(self.mlp_conv, self.mlp, h, block), residual

    @staticmethod
    def _convolved(conv: GroupedDynamicConv | None, sublayer, h: torch.Tensor, block: DraftBlock) -> torch.Tensor:
        if conv is None:
            return sublayer(h)
        h, deltas = conv.prepare(h, block.block_len)
        return conv.finish(sublayer(h), deltas, block.block_len)


class DflashDraftModel(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.layers = nn.ModuleList(DflashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.candidate_selector: CandidateSelector | None = None
        if config.is_dflash2:
            self.candidate_selector = CandidateSelector(
                hidden, config.vocab_size, config.selector_rank, config.selector_top_k
            )

    def allocate_kv(
        self, num_pages: int, page_size: int, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> KVCache:
        """The drafter's context KV: one layer per drafter layer, pages indexed like the target's."""
        c = self.config
        param = next(self.parameters())
        return KVCache.allocate(c.num_hidden_layers, num_pages, page_size, c.num_key_value_heads, c.head_dim,
                                dtype or param.dtype, device or param.device)

    def store_context(
        self, aux_hidden: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
    ) -> None:
        """aux_hidden [T, len(target_layer_ids), H]: the target's streams of T computed tokens at
        positions [T]; every layer's context K/V go to slot_mapping [T]."""
        context = self.hidden_norm(self.fc(aux_hidden.flatten(1)))
        cos, sin = self.rotary_emb(positions, context.dtype)
        for layer in self.layers:
            layer.self_attn.store_context(context, cos, sin, kv_cache, slot_mapping)

    def forward(self, embeds: torch.Tensor, block: DraftBlock, kv_cache: KVCache) -> torch.Tensor:
        """embeds [R * block_len, H] of the block rows -> final-normed hidden [R * block_len, H]."""
        cos, sin = self.rotary_emb(block.rope_positions, embeds.dtype)
        x, residual = embeds, None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, block, kv_cache)
        return self.norm.add_forward(x, residual)[0]

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The checkpoint's output multiplier and tanh soft cap on fp32 logits (ids at -inf stay there)."""
        c = self.config
        if c.logit_scale != 1.0:
            logits = logits * c.logit_scale
        if c.logit_softcap is not None:
            capped = torch.tanh(logits / c.logit_softcap) * c.logit_softcap
            logits = torch.where(logits == float("-inf"), logits, capped)
        return logits
