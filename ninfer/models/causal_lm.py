"""CausalLM: what every architecture's top module offers the runner and the engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ninfer.kernels.causal_conv1d import commit_conv_state
from ninfer.kernels.gated_delta_rule import commit_gated_delta_rule
from ninfer.models.config import ModelConfig
from ninfer.models.forward_batch import ForwardBatch
from ninfer.models.kv_cache import KVCache
from ninfer.models.layers.gated_deltanet import GatedDeltaNet
from ninfer.models.state_cache import StateCache
from ninfer.models.verify_scratch import VerifyScratch


@dataclass(frozen=True)
class CacheSpec:
    """Sizes the engine needs to allocate a model's KV pages and state slots."""

    num_attention_layers: int
    num_kv_heads: int
    head_dim: int
    num_linear_layers: int = 0
    conv_dim: int = 0
    conv_kernel: int = 0
    num_v_heads: int = 0
    k_head_dim: int = 0
    v_head_dim: int = 0


class CausalLM(nn.Module):
    """Subclasses build `model` (the trunk, with `embed_tokens`) and `lm_head`, and implement forward.

    forward(input_ids [T], batch) -> final-normed hidden states [T, H], updating the
    caches referenced by the batch; compute_logits maps selected rows to vocab logits.
    """

    config: ModelConfig
    lm_head: nn.Linear
    _gdn_gates: tuple[torch.Tensor, torch.Tensor, int] | None = None  # commit_verified's stacked A_log, dt_bias

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Share the input embedding with lm_head when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def cache_spec(self) -> CacheSpec:
        c = self.config
        spec = CacheSpec(
            num_attention_layers=len(c.attention_layer_ids),
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
        )
        if not c.is_hybrid:
            return spec
        return CacheSpec(
            num_attention_layers=spec.num_attention_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            num_linear_layers=len(c.linear_layer_ids),
            conv_dim=c.linear_conv_dim,
            conv_kernel=c.linear_conv_kernel_dim,
            num_v_heads=c.linear_num_value_heads,
            k_head_dim=c.linear_key_head_dim,
            v_head_dim=c.linear_value_head_dim,
        )

    def allocate_caches(
        self,
        num_pages: int,
        page_size: int,
        num_state_slots: int,
        dtype: torch.dtype | None = None,
        kv_format: str = "bf16",
    ) -> tuple[KVCache, StateCache | None]:
        """Storage for num_pages KV pages (kv_format: a KV_DTYPES name) and num_state_slots
        StateImages on the model's device."""
        spec = self.cache_spec()
        param = next(self.parameters())
        dtype = dtype or param.dtype
        kv = KVCache.allocate(
            spec.num_attention_layers, num_pages, page_size, spec.num_kv_heads, spec.head_dim, dtype, param.device,
            kv_format,
        )
        if not spec.num_linear_layers:
            return kv, None
        states = StateCache.allocate(
            spec.num_linear_layers,
            num_state_slots,
            spec.conv_dim,
            spec.conv_kernel,
            spec.num_v_heads,
            spec.k_head_dim,
            spec.v_head_dim,
            dtype,
            param.device,
        )
        return kv, states

    def allocate_verify_scratch(self, max_rows: int, dtype: torch.dtype | None = None) -> VerifyScratch | None:
        """Scratch for up to max_rows speculative verification rows a step (None: no state layers)."""
        spec = self.cache_spec()
        if not spec.num_linear_layers:
            return None
        param = next(self.parameters())
        return VerifyScratch.allocate(
            spec.num_linear_layers, max_rows, spec.conv_dim, spec.num_v_heads, dtype or param.dtype, param.device
        )

    def commit_verified(
        self, scratch: VerifyScratch | None, state_cache: StateCache | None, slots: torch.Tensor,
        row_starts: torch.Tensor, counts: torch.Tensor, max_count: int,
    ) -> None:
        """Advance state slot slots[i] by scratch rows row_starts[i] .. + counts[i] - 1 (the
        verification rows it accepted, see VerifyScratch), every Gated DeltaNet layer at once;
        the index tensors may live on the device (nothing here reads them on the host).
        Attention layers need nothing: their KV was written for every row, and rows past the
        accepted ones are overwritten before anything reads them."""
        if scratch is None or state_cache is None:
            return
        if self._gdn_gates is None:
            layers = sorted((m for m in self.modules() if isinstance(m, GatedDeltaNet)), key=lambda m: m.state_layer_index)
            with torch.no_grad():  # weights are fixed once loaded: stack them once
                self._gdn_gates = (
                    torch.stack([m.A_log.detach() for m in layers]),
                    torch.stack([m.dt_bias.detach() for m in layers]),
                    layers[0].num_k_heads,
                )
        a_log, dt_bias, num_k_heads = self._gdn_gates
        commit_conv_state(scratch.conv_inputs, state_cache.conv, slots, row_starts, counts, max_count)
        commit_gated_delta_rule(
            scratch.mixed, scratch.gates, a_log, dt_bias, state_cache.recurrent, slots, row_starts, counts,
            num_k_heads, max_count,
        )
