"""Qwen3-Next: the Qwen3.5 hybrid trunk with plain 1-D partial RoPE and Qwen3-MoE-style sparsity.

Every difference is configuration the shared classes already honour: no mrope_section
(RotaryEmbedding falls back to 1-D), decoder_sparse_step / mlp_only_layers choose MoE or a
dense MLP per layer, norm_topk_prob is read from the config. Checkpoint layout differences
(fused in_proj_qkvz / in_proj_ba, per-expert tensors) live in checkpoint/qwen3_next.py.
"""

from __future__ import annotations

from ninfer.models.qwen3_5 import Qwen3_5ForCausalLM


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    pass
