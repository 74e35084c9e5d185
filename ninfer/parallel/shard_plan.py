"""ShardPlan: which part of every parameter one tensor-parallel rank holds, in the full model's terms.

Column-parallel (split by output rows, no reduction): attention q|k|v by heads (a KV head is
replicated on the ranks whose query heads read it when there are fewer KV heads than ranks), the
Gated DeltaNet's in_proj by key and value heads (q, k, v, z, b, a) with the conv channels,
A_log and dt_bias of its value heads, MLP gate|up and the routed experts' gate|up by the
intermediate dimension. Row-parallel (split by input columns; the ranks' outputs are summed,
partial_sums.py): o_proj, out_proj, down_proj and the experts' down_proj; their biases stay on
rank 0 only, so the sum adds them once. Everything else is replicated: embeddings, lm_head,
norms, MoE routers and the shared expert's gate.

A rank's model is built from local_config (its heads and intermediate sizes) and filled by the
loader through localize(): each checkpoint write, in the full parameter's coordinates, becomes
the writes of the rows or columns this rank holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ninfer.models.config import ModelConfig
from ninfer.models.layers.attention import Attention
from ninfer.models.layers.gated_deltanet import GatedDeltaNet
from ninfer.models.layers.linear import packed_parts
from ninfer.models.layers.mlp import MLP
from ninfer.models.layers.moe import SparseMoE
from ninfer.models.meta_build import meta_build
from ninfer.models.quant.stored_write import StoredWrite
from ninfer.models.registry import model_class
from ninfer.models.weight_load_error import WeightLoadError

Span = tuple[int, int]  # [start, stop) along the split dimension, in the full parameter


@dataclass(frozen=True)
class Split:
    """The rank holds these spans of dimension `dim`, concatenated in this order."""

    dim: int
    spans: tuple[Span, ...]

    @property
    def size(self) -> int:
        return sum(stop - start for start, stop in self.spans)


@dataclass(frozen=True)
class LeaderOnly:
    """A row-parallel layer's bias: rank 0 holds it, the others zeros (the sum adds it once)."""


Shard = Split | LeaderOnly


def tensor_parallel_problem(config: ModelConfig, size: int) -> str | None:
    """Why `config`'s model does not split over `size` ranks, or None."""
    if size == 1:
        return None
    checks = [("attention heads", config.num_attention_heads)]
    kv = config.num_key_value_heads
    if kv % size and size % kv:
        return f"its KV heads ({kv}) can neither be divided among {size} ranks nor divide them"
    if any(not config.layer_is_moe(i) for i in range(config.num_hidden_layers)):
        checks.append(("MLP intermediate size", config.intermediate_size))
    if config.is_hybrid:
        checks += [("Gated DeltaNet key heads", config.linear_num_key_heads),
                   ("Gated DeltaNet value heads", config.linear_num_value_heads)]  # fmt: skip
    if config.is_moe:
        checks.append(("expert intermediate size", config.moe_intermediate_size))
        if config.shared_expert_intermediate_size:
            checks.append(("shared expert intermediate size", config.shared_expert_intermediate_size))
    for what, count in checks:
        if count % size:
            return f"its {what} ({count}) cannot be divided among {size} ranks"
    return None


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The configuration one rank's model is built from: its share of every split dimension."""
    return config.replace(
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=max(1, config.num_key_value_heads // size),
        intermediate_size=config.intermediate_size // size,
        linear_num_key_heads=config.linear_num_key_heads // size,
        linear_num_value_heads=config.linear_num_value_heads // size,
        moe_intermediate_size=config.moe_intermediate_size // size,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // size,
    )


class ShardPlan:
    def __init__(self, config: ModelConfig, rank: int, size: int):
        problem = tensor_parallel_problem(config, size)
        if problem is not None:
            raise ValueError(f"the model does not split over {size} ranks: {problem}")
        self.full_config = config
        self.rank = rank
        self.size = size
        self.local_config = local_config(config, size) if size > 1 else config
        with meta_build():
            full = model_class(config)(config)
        self.full_shapes = {name: tuple(t.shape) for name, t in full.named_parameters()}
        # Stored part -> (packed parameter, its rows), in the full model: checkpoint writes come in these terms.
        self.full_packed_parts = packed_parts(full)
        self.shards: dict[str, Shard] = {}
        for name, module in full.named_modules():
            prefix = f"{name}." if name else ""
            if isinstance(module, Attention):
                self._attention(prefix, module, config)
            elif isinstance(module, GatedDeltaNet):
                self._gated_deltanet(prefix, config)
            elif isinstance(module, MLP):  # shared experts included: an MLP inside its MoE block
                self._mlp(prefix, module)
            elif isinstance(module, SparseMoE):
                inter = config.moe_intermediate_size
                self.shards[f"{prefix}experts.gate_up_proj"] = Split(1, (self._block(0, inter), self._block(inter, inter)))
                self.shards[f"{prefix}experts.down_proj"] = Split(2, (self._block(0, inter),))

    def _block(self, offset: int, length: int) -> Span:
        """This rank's equal share of `length` rows starting at `offset`."""
        share = length // self.size
        return offset + self.rank * share, offset + (self.rank + 1) * share

    def _attention(self, prefix: str, module: Attention, config: ModelConfig) -> None:
        head_dim = config.head_dim
        query_rows = config.num_attention_heads * head_dim * (2 if config.attn_output_gate else 1)
        kv_heads = config.num_key_value_heads
        kv_rows = kv_heads * head_dim
        if kv_heads >= self.size:
            kv = self._block(0, kv_rows)
        else:  # fewer KV heads than ranks: each rank holds the one its query heads read
            head = self.rank // (self.size // kv_heads)
            kv = (head * head_dim, (head + 1) * head_dim)
        columns = Split(0, (self._block(0, query_rows), _shift(kv, query_rows), _shift(kv, query_rows + kv_rows)))
        self.shards[f"{prefix}qkv_proj.weight"] = columns
        if module.qkv_proj.bias is not None:
            self.shards[f"{prefix}qkv_proj.bias"] = columns
        self._row_parallel(f"{prefix}o_proj", module.o_proj, config.num_attention_heads * head_dim)

    def _gated_deltanet(self, prefix: str, config: ModelConfig) -> None:
        key_dim, value_dim, num_v_heads = config.linear_key_dim, config.linear_value_dim, config.linear_num_value_heads
        conv_dim = config.linear_conv_dim
        q, k, v = self._block(0, key_dim), self._block(key_dim, key_dim), self._block(2 * key_dim, value_dim)
        z = self._block(conv_dim, value_dim)
        b = self._block(conv_dim + value_dim, num_v_heads)
        a = self._block(conv_dim + value_dim + num_v_heads, num_v_heads)
        self.shards[f"{prefix}in_proj.weight"] = Split(0, (q, k, v, z, b, a))
        self.shards[f"{prefix}conv1d.weight"] = Split(0, (q, k, v))
        heads = Split(0, (self._block(0, num_v_heads),))
        self.shards[f"{prefix}A_log"] = heads
        self.shards[f"{prefix}dt_bias"] = heads
        self.shards[f"{prefix}out_proj.weight"] = Split(1, (self._block(0, value_dim),))

    def _mlp(self, prefix: str, module: MLP) -> None:
        inter = module.down_proj.in_features
        gate_up = Split(0, (self._block(0, inter), self._block(inter, inter)))
        self.shards[f"{prefix}gate_up_proj.weight"] = gate_up
        if module.gate_up_proj.bias is not None:
            self.shards[f"{prefix}gate_up_proj.bias"] = gate_up
        self._row_parallel(f"{prefix}down_proj", module.down_proj, inter)

    def _row_parallel(self, name: str, linear: nn.Linear, in_features: int) -> None:
        self.shards[f"{name}.weight"] = Split(1, (self._block(0, in_features),))
        if linear.bias is not None:
            self.shards[f"{name}.bias"] = LeaderOnly()

    # ---- whole tensors --------------------------------------------------------------------------
    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full parameter `name`."""
        shard = self.shards.get(name)
        if shard is None:
            return full
        if isinstance(shard, LeaderOnly):
            return full if self.rank == 0 else torch.zeros_like(full)
        return torch.cat([full.narrow(shard.dim, start, stop - start) for start, stop in shard.spans], shard.dim)

    @staticmethod
    def unshard(plans: list[ShardPlan], name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full parameter `name` from every rank's part (plans and parts by rank); ValueError when
        two ranks disagree where they hold the same elements (replicated parts, shared KV heads)."""
        shard = plans[0].shards.get(name)
        if shard is None:
            if any(not torch.equal(parts[0], other) for other in parts[1:]):
                raise ValueError(f"{name}: the ranks' copies differ")
            return parts[0]
        if isinstance(shard, LeaderOnly):
            if any(other.count_nonzero() for other in parts[1:]):
                raise ValueError(f"{name}: a rank other than 0 holds a nonzero bias")
            return parts[0]
        full = torch.full(plans[0].full_shapes[name], float("nan"), dtype=parts[0].dtype)
        for plan, part in zip(plans, parts):
            offset = 0
            for start, stop in plan.shards[name].spans:
                piece = part.narrow(shard.dim, offset, stop - start)
                target = full.narrow(shard.dim, start, stop - start)
                if not target.isnan().all() and not torch.equal(target, piece):
                    raise ValueError(f"{name}: ranks disagree on elements {start}..{stop} of dimension {shard.dim}")
                target.copy_(piece)
                offset += stop - start
        return full

    # ---- checkpoint writes ----------------------------------------------------------------------
    def localize(self, write: StoredWrite) -> list[StoredWrite]:
        """The writes of this rank's parts that the full-coordinate `write` makes (none where it
        holds none of it); their indexes are into the rank's own parameter. A quantized write's
        scales go with its values (StoredWrite.narrowed)."""
        shard = self.shards.get(write.param_name)
        if shard is None:
            return [write]
        if isinstance(shard, LeaderOnly):
            return [write if self.rank == 0 else dataclasses.replace(write, value=torch.zeros_like(write.value))]
        box = _box(write.index, self.full_shapes[write.param_name])
        start, stop, kept = box[shard.dim]
        # A dimension an integer index selects (an expert) is not one of the value's.
        value_dim = shard.dim - sum(1 for _, _, keep in box[: shard.dim] if not keep)
        writes = []
        offset = 0
        for span_start, span_stop in shard.spans:
            low, high = max(span_start, start), min(span_stop, stop)
            if low < high:
                local = list(box)
                local[shard.dim] = (offset + low - span_start, offset + high - span_start, kept)
                part = write.narrowed(value_dim, low - start, high - low) if kept else write
                local_shape = list(self.full_shapes[write.param_name])
                local_shape[shard.dim] = shard.size
                writes.append(dataclasses.replace(part, index=_index(local, local_shape)))
            offset += span_stop - span_start
        return writes


def _shift(span: Span, offset: int) -> Span:
    return span[0] + offset, span[1] + offset


def _box(index: object, shape: tuple[int, ...]) -> list[tuple[int, int, bool]]:
    """A write's index as (start, stop, keeps the dimension) for every dimension of the parameter:
    None (all of it), a slice of rows, an expert, or (expert, rows)."""
    parts = index if isinstance(index, tuple) else () if index is None else (index,)
    box = []
    for dim, size in enumerate(shape):
        part = parts[dim] if dim < len(parts) else slice(None)
        if isinstance(part, slice):
            start, stop, step = part.indices(size)
            if step != 1:
                raise WeightLoadError(f"a strided write ({index!r}) cannot be split over tensor-parallel ranks")
            box.append((start, stop, True))
        else:
            box.append((int(part), int(part) + 1, False))
    return box


def _index(box: list[tuple[int, int, bool]], shape: list[int]) -> object:
    """The box as an index into a parameter of `shape`, without the trailing dimensions it takes
    whole: a quantized module's scales have fewer dimensions than its weight, or other sizes."""
    parts = [slice(start, stop) if keep else start for start, stop, keep in box]
    while parts and isinstance(parts[-1], slice) and (parts[-1].start, parts[-1].stop) == (0, shape[len(parts) - 1]):
        parts.pop()
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else tuple(parts)
