"""A model's runtime layout: the tensors a built model holds, by the names it holds them under.

Checkpoints store projections separately and in their producer's format; the loader packs
and converts them (loader.py). A model saved in its runtime layout (packed projections, FP8
weights with their scales, NVFP4 codes with theirs) loads back by plain copies: `runtime_tensors` names what to
save, `quantized_modules` records which Linear layers (and fused MoE experts) were replaced
by quantized modules (and their scales' layout) so `build_runtime_model` can rebuild the same
module tree.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ninfer.models.causal_lm import CausalLM
from ninfer.models.config import ModelConfig
from ninfer.models.layers.moe import Experts
from ninfer.models.loader import QUANTIZE_AT_LOAD, WeightLoadError, build_model, materialize
from ninfer.models.quant.fp8 import SCALE_BLOCK, Fp8Linear
from ninfer.models.quant.fp8_experts import PROJECTIONS, Fp8Experts
from ninfer.models.quant.nvfp4 import Nvfp4Linear
from ninfer.models.quant.nvfp4_experts import Nvfp4Experts
from ninfer.models.quant.stored_write import StoredWrite

if TYPE_CHECKING:
    from ninfer.parallel.shard_plan import ShardPlan

FP8_LINEAR = "fp8_linear"
NVFP4_LINEAR = "nvfp4_linear"
# FP8 experts record weight rows per scale row: null (per output row), 128 (128 x 128 blocks) or 1.
FP8_EXPERTS = "fp8_experts"
NVFP4_EXPERTS = "nvfp4_experts"
# Stored bits that must arrive as they are; floating tensors may widen (bf16 stored, fp32 model).
_EXACT_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def runtime_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every stored tensor of `model` under its state-dict name: parameters (a tied one once,
    under its first name) and persistent buffers (FP8 weights and scales); computed buffers
    such as rotary tables are not state."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensors[name] = tensor.detach()
    return tensors


def quantized_modules(model: nn.Module) -> dict[str, dict[str, object]]:
    """Module name -> how it is quantized, for every quantized Linear and fused experts of `model`."""
    modules: dict[str, dict[str, object]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            modules[name] = {"kind": FP8_LINEAR, "scale_shape": list(module.weight_scale.shape)}
        elif isinstance(module, Fp8Experts):
            modules[name] = {"kind": FP8_EXPERTS, "rows_per_block": module.rows_per_block("gate_up_proj")}
        elif isinstance(module, Nvfp4Linear):
            modules[name] = {"kind": NVFP4_LINEAR}
        elif isinstance(module, Nvfp4Experts):
            modules[name] = {"kind": NVFP4_EXPERTS}
    return modules


def build_runtime_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    modules: dict[str, dict[str, object]],
    source: str,
    quantize: str | None = None,
    shard: ShardPlan | None = None,
) -> CausalLM:
    """An uninitialised model whose quantized Linear layers and experts are those `modules` records.

    Entries for modules the model lacks are skipped when they belong to an optional part the
    config leaves out (the MTP head), else they are an error naming the module.
    quantize: "fp8" | "nvfp4": the modules it would convert among the rest are built quantized
    too, for load_runtime_tensors to quantize their saved unquantized weights into.
    shard: one tensor-parallel rank's model (`modules` describes the whole model's)."""
    model = build_model(config, dtype, "meta", shard=shard)
    for module_name, entry in sorted(modules.items()):
        kind = entry.get("kind")
        if kind not in (FP8_LINEAR, NVFP4_LINEAR, FP8_EXPERTS, NVFP4_EXPERTS):
            raise WeightLoadError(f"{source}: module {module_name!r} has unknown quantization {kind!r}")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            if _optional(module_name, config):
                continue
            raise WeightLoadError(f"{source}: quantized module {module_name!r} is not part of this model") from None
        if kind == FP8_EXPERTS:
            rows_per_block = entry.get("rows_per_block")
            if shard is not None and rows_per_block == SCALE_BLOCK and isinstance(module, Experts):
                # A rank's gate and up rows start at multiples of its share: on block edges or not.
                rows_per_block = SCALE_BLOCK if module.down_proj.shape[-1] % SCALE_BLOCK == 0 else 1
            replacement: nn.Module = _fp8_experts_placeholder(module, rows_per_block, module_name, source)
        elif kind == NVFP4_EXPERTS:
            if not isinstance(module, Experts):
                raise WeightLoadError(f"{source}: NVFP4 experts {module_name!r} are not fused experts here")
            try:
                replacement = Nvfp4Experts.placeholder(module)
            except ValueError as error:
                raise WeightLoadError(f"{source}: NVFP4 experts {module_name!r}: {error}") from None
        elif not isinstance(module, nn.Linear):
            raise WeightLoadError(f"{source}: quantized module {module_name!r} is not a Linear layer here")
        elif kind == FP8_LINEAR:
            scale_shape = tuple(int(size) for size in entry.get("scale_shape", ()))  # type: ignore[union-attr]
            full_shape = shard.full_shapes[f"{module_name}.weight"] if shard is not None else tuple(module.weight.shape)
            replacement = _fp8_placeholder(module, full_shape, scale_shape, module_name, source)
        else:
            try:
                replacement = Nvfp4Linear.placeholder(module)
            except ValueError as error:
                raise WeightLoadError(f"{source}: NVFP4 module {module_name!r}: {error}") from None
        parent_name, _, child_name = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, replacement)
    if quantize is not None:
        QUANTIZE_AT_LOAD[quantize](model, placeholders=True)
    return materialize(model, device)


def _fp8_placeholder(
    linear: nn.Linear, full_shape: tuple[int, ...], scale_shape: tuple[int, ...], module_name: str, source: str
) -> Fp8Linear:
    """full_shape: the whole model's weight, whose scales the entry records (linear may be a rank's part)."""
    out_features, in_features = full_shape
    per_channel = (out_features,)
    row_blocks = (out_features, -(-in_features // 128))
    if scale_shape not in (per_channel, row_blocks):
        raise WeightLoadError(
            f"{source}: FP8 module {module_name!r} has scales of shape {list(scale_shape)}; "
            f"a [{out_features}, {in_features}] weight takes {list(per_channel)} or {list(row_blocks)}"
        )
    return Fp8Linear.placeholder(linear, per_channel=scale_shape == per_channel)


def _fp8_experts_placeholder(experts: nn.Module, rows_per_block, module_name: str, source: str) -> Fp8Experts:
    if not isinstance(experts, Experts):
        raise WeightLoadError(f"{source}: FP8 experts {module_name!r} are not fused experts here")
    if rows_per_block not in (None, 1, SCALE_BLOCK):
        raise WeightLoadError(
            f"{source}: FP8 experts {module_name!r} have {rows_per_block!r} rows per scale; expected null, 1 or {SCALE_BLOCK}"
        )
    return Fp8Experts.placeholder(experts, rows_per_block)


def _optional(name: str, config: ModelConfig) -> bool:
    return name.startswith("mtp.") and not config.mtp_num_hidden_layers


def load_runtime_tensors(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    source: str,
    quantized_at_load: Iterable[str] = (),
    dtype: torch.dtype | None = None,
    shard: ShardPlan | None = None,
) -> None:
    """Copy saved runtime tensors into `model`: every tensor it holds written exactly once with
    the saved shape; a saved tensor the model lacks is an error unless it belongs to an
    optional part the model was built without (the MTP head).
    quantized_at_load: modules built quantized whose weights were saved unquantized; each such
    weight is rounded to dtype and quantized into its module as it arrives (row_chunks.py).
    shard: `model` is one tensor-parallel rank's and the tensors the whole model's: each plain
    tensor keeps the rank's part (ShardPlan.shard), and each quantized weight, once its scales
    have arrived too, goes to its module as a checkpoint write of the rank's part."""
    targets = runtime_tensors(model)
    config = getattr(model, "config", None)
    arriving = _arriving_weights(model, quantized_at_load)
    saved_quantized = _saved_quantized(model, quantized_at_load) if shard is not None else {}
    held: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # a quantized weight's tensors until all came
    written: set[str] = set()
    with torch.no_grad():
        for name, tensor in tensors:
            if name in saved_quantized and name not in written:
                module_name, module, attribute, names = saved_quantized[name]
                parts = held.setdefault((module_name, attribute), {})
                parts[name.removeprefix(module_name + ".")] = tensor
                if len(parts) == len(names):
                    write = _saved_write(module, module_name, attribute, held.pop((module_name, attribute)), source)
                    for local in shard.localize(write):
                        module.load_stored(attribute, local, dtype)
                    written.update(f"{module_name}.{part}" for part in names)
                continue
            if shard is not None:
                tensor = shard.shard(name, tensor)
            if name in arriving and name not in written:
                module, attribute, filled = arriving[name]
                _quantize_saved(module, attribute, name, tensor, dtype, source)
                written.update(filled)
                continue
            target = targets.get(name)
            if target is None:
                if config is not None and _optional(name, config):
                    continue
                raise WeightLoadError(f"{source}: tensor {name!r} is not part of this model")
            if name in written:
                raise WeightLoadError(f"{source}: tensor {name!r} appears twice")
            if tuple(target.shape) != tuple(tensor.shape):
                raise WeightLoadError(
                    f"{source}: tensor {name!r} has shape {list(tensor.shape)}, the model expects {list(target.shape)}"
                )
            exact = target.dtype in _EXACT_DTYPES or tensor.dtype in _EXACT_DTYPES
            if exact and target.dtype != tensor.dtype:
                raise WeightLoadError(f"{source}: tensor {name!r} is {tensor.dtype}, the model holds {target.dtype}")
            target.copy_(tensor)
            written.add(name)
    missing = [name for name in targets if name not in written]
    if missing:
        shown = ", ".join(missing[:8]) + (" …" if len(missing) > 8 else "")
        raise WeightLoadError(f"{source}: {len(missing)} tensors were not loaded: {shown}")


def _arriving_weights(model: nn.Module, module_names: Iterable[str]) -> dict[str, tuple[nn.Module, str, list[str]]]:
    """Saved weight name -> (its quantized module, the weight's attribute, the runtime tensors it fills)."""
    arriving: dict[str, tuple[nn.Module, str, list[str]]] = {}
    for module_name in module_names:
        module = model.get_submodule(module_name)
        if isinstance(module, (Fp8Experts, Nvfp4Experts)):
            for projection in PROJECTIONS:
                suffixes = ("", "_scale") if isinstance(module, Fp8Experts) else ("", "_block_scale", "_row_scale")
                filled = [f"{module_name}.{projection}{suffix}" for suffix in suffixes]
                arriving[filled[0]] = (module, projection, filled)
        else:
            buffers = [f"{module_name}.{name}" for name, _ in module.named_buffers(recurse=False)]
            arriving[f"{module_name}.weight"] = (module, "weight", buffers)
    return arriving


def _saved_quantized(model: nn.Module, quantized_at_load: Iterable[str]) -> dict[str, tuple[str, nn.Module, str, tuple[str, ...]]]:
    """Saved tensor name -> (its quantized module's name, the module, the weight's attribute, the
    names within the module of that weight's saved tensors: codes then scales), for the modules
    saved quantized."""
    at_load = set(quantized_at_load)
    saved: dict[str, tuple[str, nn.Module, str, tuple[str, ...]]] = {}
    for module_name, module in model.named_modules():
        if module_name in at_load:
            continue
        if isinstance(module, Fp8Linear):
            weights = {"weight": ("weight", "weight_scale")}
        elif isinstance(module, Nvfp4Linear):
            weights = {"weight": ("weight", "block_scale", "row_scale")}
        elif isinstance(module, Fp8Experts):
            weights = {p: (p, f"{p}_scale") for p in PROJECTIONS}
        elif isinstance(module, Nvfp4Experts):
            weights = {p: (p, f"{p}_block_scale", f"{p}_row_scale") for p in PROJECTIONS}
        else:
            continue
        for attribute, names in weights.items():
            for part in names:
                saved[f"{module_name}.{part}"] = (module_name, module, attribute, names)
    return saved


def _saved_write(
    module: nn.Module, module_name: str, attribute: str, parts: dict[str, torch.Tensor], source: str
) -> StoredWrite:
    """A quantized module's saved weight (whole-model shape) as the checkpoint write the shard plan
    cuts: FP8 scales as a row of 128-column block scales per weight row, NVFP4 as saved."""
    what = f"{source}: tensor {module_name}.{attribute}"
    value = parts[attribute]
    if isinstance(module, (Nvfp4Linear, Nvfp4Experts)):
        suffix = "" if attribute == "weight" else f"{attribute}_"
        block, row = parts[f"{suffix}block_scale"], parts[f"{suffix}row_scale"]
        return StoredWrite(what, f"{module_name}.{attribute}", None, value, nvfp4_scales=(block, row))
    scale = parts[f"{attribute}_scale"]
    rows, num_blocks = value.shape[-2], -(-value.shape[-1] // SCALE_BLOCK)
    if scale.dim() == value.dim() - 1:  # one scale per output row
        row_scales = scale[..., None].expand(*scale.shape, num_blocks)
    elif scale.shape[-2] == rows:  # a scale row per weight row
        row_scales = scale
    else:  # 128-row blocks
        row_scales = scale.repeat_interleave(SCALE_BLOCK, dim=-2)[..., :rows, :]
    return StoredWrite(what, f"{module_name}.{attribute}", None, value, fp8_row_scales=row_scales)


def _quantize_saved(
    module: nn.Module, attribute: str, name: str, tensor: torch.Tensor, dtype: torch.dtype | None, source: str
) -> None:
    weight = getattr(module, attribute)
    expected = tuple(weight.shape)
    if isinstance(module, (Nvfp4Linear, Nvfp4Experts)):
        expected = (*weight.shape[:-1], weight.shape[-1] * 2)  # two codes a byte
    if not tensor.is_floating_point() or tuple(tensor.shape) != expected:
        raise WeightLoadError(
            f"{source}: tensor {name!r} is {tensor.dtype} {list(tensor.shape)}; quantized at load, "
            f"the model expects an unquantized {list(expected)}"
        )
    if isinstance(module, (Fp8Experts, Nvfp4Experts)):
        module.quantize_into(attribute, None, tensor, dtype)
    else:
        module.quantize_into(None, tensor, dtype)
