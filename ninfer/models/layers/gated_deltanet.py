"""GatedDeltaNet: Qwen3.5 / Qwen3-Next linear-attention token mixer over per-slot states.

Projections in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (Qwen3.5 checkpoint names;
Qwen3-Next's fused in_proj_qkvz / in_proj_ba are split by its checkpoint rule) packed into
one matrix, a depthwise causal conv over q|k|v, the gated delta rule, then a silu(z)-gated
RMSNorm per v-head.
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer.kernels.causal_conv1d import causal_conv1d, causal_conv1d_padded
from ninfer.kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_padded,
    gdn_gates,
    recurrent_gated_delta_rule_with_gates,
)
from ninfer.models.config import ModelConfig
from ninfer.models.forward_batch import ForwardBatch
from ninfer.models.layers.linear import Linear, PackedLinear
from ninfer.models.layers.norm import GatedRMSNorm


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, state_layer_index: int):
        super().__init__()
        self.state_layer_index = state_layer_index  # index among the model's linear layers in the StateCache
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.k_head_dim = config.linear_key_head_dim
        self.v_head_dim = config.linear_value_head_dim
        self.key_dim = config.linear_key_dim
        self.value_dim = config.linear_value_dim
        conv_dim = config.linear_conv_dim
        hidden = config.hidden_size
        self.in_proj = PackedLinear(
            hidden,
            {
                "in_proj_qkv": conv_dim,
                "in_proj_z": self.value_dim,
                "in_proj_b": self.num_v_heads,
                "in_proj_a": self.num_v_heads,
            },
        )
        self.in_proj_sizes = self.in_proj.part_sizes  # kept here: quantization may replace the Linear
        # nn.Conv1d only for its checkpoint-compatible weight [conv_dim, 1, K]; the op is causal_conv1d.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.v_head_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        num_tokens = x.shape[0]
        conv_state, recurrent_state = batch.state_cache.layer(self.state_layer_index)
        conv_weight = self.conv1d.weight.squeeze(1)

        split = (self.key_dim, self.key_dim, self.value_dim)
        if batch.is_decode_only:
            # One token per request: the conv's step rides in the projection's GEMV epilogue.
            mixed = self.in_proj.forward_causal_conv1d_update(x, conv_weight, conv_state, batch.state_slots)
            qkv, z, b, a = mixed.split(self.in_proj_sizes, dim=-1)
            q, k, v = self._heads(*qkv.split(split, dim=-1))
            # The decode kernel computes the gates itself (one launch fewer per layer).
            core = recurrent_gated_delta_rule_with_gates(
                q, k, v, a, b, self.A_log, self.dt_bias, recurrent_state, batch.state_slots, batch.query_lens_cpu
            )
        elif batch.padded is not None:
            qkv, z, b, a = self.in_proj(x).split(self.in_proj_sizes, dim=-1)
            core = self._padded(qkv, a, b, batch)
        else:
            qkv, z, b, a = self.in_proj(x).split(self.in_proj_sizes, dim=-1)
            verify = batch.verify
            num_verify = verify.num_tokens if verify is not None else 0
            parts = []
            if num_verify:
                parts.append(self._verify_rows(qkv[:num_verify], a[:num_verify], b[:num_verify], batch))
            if num_verify < num_tokens:
                first = verify.num_requests if verify is not None else 0
                snapshots = batch.snapshots
                # Requests that continue an earlier one of this batch run after it (same slot).
                last = batch.num_requests - (snapshots.num_continuing_requests if snapshots is not None else 0)
                split_row = num_verify + sum(batch.query_lens_cpu[first:last])
                parts.append(self._chunked(qkv, a, b, num_verify, split_row, first, last, batch))
                if snapshots is not None:
                    # The checkpoint: the slot's state after the rows before its frontier.
                    batch.state_cache.copy_layer_slots(self.state_layer_index, snapshots.src_slots, snapshots.dst_slots)
                    parts.append(self._chunked(qkv, a, b, split_row, num_tokens, last, batch.num_requests, batch))
            core = parts[0] if len(parts) == 1 else torch.cat(parts)

        z = z.reshape(num_tokens, self.num_v_heads, self.v_head_dim)
        # z is in_proj's output, with at least the rule launched since: read before the PDL wait.
        out = self.norm(core, z, early_gate=True).reshape(num_tokens, self.value_dim)
        return self.out_proj(out)

    def _chunked(
        self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_start: int, row_end: int,
        first: int, last: int, batch: ForwardBatch,
    ) -> torch.Tensor:
        """Rows [row_start, row_end) of requests [first, last) through the conv and the chunked rule."""
        conv_state, recurrent_state = batch.state_cache.layer(self.state_layer_index)
        slots, lens = batch.state_slots[first:last], batch.query_lens_cpu[first:last]
        split = (self.key_dim, self.key_dim, self.value_dim)
        rows = slice(row_start, row_end)
        # Contiguous q, k, v straight from the conv: the chunked kernels would copy views.
        q, k, v = causal_conv1d(qkv[rows], self.conv1d.weight.squeeze(1), conv_state, slots, lens, split)
        # Gates in fp32: exp(A_log) overflows half precision and g feeds an exp per token.
        g, beta = gdn_gates(a[rows], b[rows], self.A_log, self.dt_bias)
        return chunk_gated_delta_rule(*self._heads(q, k, v), g, beta, recurrent_state, slots, lens)

    def _padded(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """A step at a captured graph's shape (models/padded_step.py): every pass runs over all rows
        with the requests outside it empty; a second pass (the requests continuing at a checkpoint
        inside the step) follows the copy of their slots' states to the checkpoints' slots."""
        padded = batch.padded
        conv_state, recurrent_state = batch.state_cache.layer(self.state_layer_index)
        conv_weight = self.conv1d.weight.squeeze(1)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        outputs = []
        for index, segments in enumerate(padded.passes):
            if index:
                snapshots = batch.snapshots
                batch.state_cache.copy_layer_slots(self.state_layer_index, snapshots.src_slots, snapshots.dst_slots)
            q, k, v = causal_conv1d_padded(
                qkv, conv_weight, conv_state, segments.state_slots, segments.conv_starts, padded.max_query_len,
                (self.key_dim, self.key_dim, self.value_dim),
            )  # fmt: skip
            outputs.append(chunk_gated_delta_rule_padded(
                *self._heads(q, k, v), g, beta, recurrent_state, segments.state_slots, segments.starts,
                segments.chunk_indices, segments.chunk_offsets,
            ))  # fmt: skip
        if len(outputs) == 1:
            return outputs[0]
        return torch.where(padded.second_pass_rows, outputs[1], outputs[0])

    def _heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        num_tokens = q.shape[0]
        return (
            q.reshape(num_tokens, self.num_k_heads, self.k_head_dim),
            k.reshape(num_tokens, self.num_k_heads, self.k_head_dim),
            v.reshape(num_tokens, self.num_v_heads, self.v_head_dim),
        )

    def _verify_rows(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Score speculative verification rows token by token (as decode does) without writing
        the slots, leaving this layer's inputs in the scratch for CausalLM.commit_verified."""
        verify = batch.verify
        num_rows, layer = verify.num_tokens, self.state_layer_index
        conv_state, recurrent_state = batch.state_cache.layer(layer)
        slots, lens = batch.state_slots[: verify.num_requests], batch.query_lens_cpu[: verify.num_requests]
        scratch = verify.scratch
        # The kernels fill the scratch as they go (two launches per layer, no copies): the conv
        # its output and its inputs, the rule the raw gates it loads.
        mixed = causal_conv1d(
            qkv, self.conv1d.weight.squeeze(1), conv_state, slots, lens, update_state=False,
            out=scratch.mixed[layer, :num_rows], inputs_out=scratch.conv_inputs[layer, :num_rows],
        )  # fmt: skip
        q, k, v = self._heads(*mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1))
        return recurrent_gated_delta_rule_with_gates(
            q, k, v, a, b, self.A_log, self.dt_bias, recurrent_state, slots, lens, update_state=False,
            gates_out=scratch.gates[layer, :num_rows],
        )  # fmt: skip
