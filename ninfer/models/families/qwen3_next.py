"""The Qwen3-Next family: the Qwen3.5 hybrid in the older tensor layout; config and checkpoint rules.

Beyond the Qwen3.5 rules (per-expert experts, MTP), the hub checkpoints fuse the GDN input
projections with rows grouped per key head:
    in_proj_qkvz: for each key head [q (dk) | k (dk) | v (r*dv) | z (r*dv)],  r = Hv / Hk
    in_proj_ba:   for each key head [b (r) | a (r)]
which we split into in_proj_qkv ([q | k | v], head-major) / in_proj_z / in_proj_b / in_proj_a.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ninfer.models.config import ModelConfig
from ninfer.models.families import qwen3_5
from ninfer.models.families.shared_fields import gated_delta_net_fields, moe_fields, mtp_fields
from ninfer.models.family import ModelFamily, WeightSlice

if TYPE_CHECKING:
    import torch  # annotations only: the API process reads families without torch


def _split_qkvz(prefix: str, tensor: torch.Tensor, config: ModelConfig) -> Iterator[WeightSlice]:
    num_k_heads, k_dim, v_dim = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    group = config.linear_num_value_heads // num_k_heads
    hidden = tensor.shape[-1]
    q, k, v, z = tensor.view(num_k_heads, -1, hidden).split([k_dim, k_dim, group * v_dim, group * v_dim], dim=1)
    key_dim = config.linear_key_dim
    # Key head h's v/z group holds v-heads h*r .. h*r+r-1, so flattening keeps v-head order.
    yield f"{prefix}.in_proj_qkv.weight", slice(0, key_dim), q.reshape(-1, hidden)
    yield f"{prefix}.in_proj_qkv.weight", slice(key_dim, 2 * key_dim), k.reshape(-1, hidden)
    yield f"{prefix}.in_proj_qkv.weight", slice(2 * key_dim, None), v.reshape(-1, hidden)
    yield f"{prefix}.in_proj_z.weight", None, z.reshape(-1, hidden)


def _split_ba(prefix: str, tensor: torch.Tensor, config: ModelConfig) -> Iterator[WeightSlice]:
    group = config.linear_num_value_heads // config.linear_num_key_heads
    hidden = tensor.shape[-1]
    b, a = tensor.view(config.linear_num_key_heads, 2 * group, hidden).split([group, group], dim=1)
    yield f"{prefix}.in_proj_b.weight", None, b.reshape(-1, hidden)
    yield f"{prefix}.in_proj_a.weight", None, a.reshape(-1, hidden)


def convert(name: str, tensor: torch.Tensor, config: ModelConfig) -> Iterator[WeightSlice]:
    if name.endswith(".in_proj_qkvz.weight"):
        yield from _split_qkvz(name.removesuffix(".in_proj_qkvz.weight"), tensor, config)
    elif name.endswith(".in_proj_ba.weight"):
        yield from _split_ba(name.removesuffix(".in_proj_ba.weight"), tensor, config)
    else:
        yield from qwen3_5.convert(name, tensor, config)


def _config_fields(hf: dict[str, Any], rope: dict[str, Any], base_type: str) -> dict[str, Any]:
    return {
        **gated_delta_net_fields(hf),
        **moe_fields(hf),
        **mtp_fields(hf),
        "qk_norm": True,
        "attn_output_gate": bool(hf.get("attn_output_gate", True)),
        "zero_centered_norm": True,
    }


FAMILY = ModelFamily(
    name="qwen3_next",
    model_types=("qwen3_next",),
    model_class="ninfer.models.qwen3_next:Qwen3NextForCausalLM",
    checkpoint_rule=convert,
    hybrid=True,
    config_fields=_config_fields,
)
