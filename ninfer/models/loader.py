"""Build a model on the meta device and fill it from checkpoint tensors.

Loading stays outside the model files: each family's checkpoint rule (registry.py) maps
stored tensors to parameter writes, possibly slices (fused experts, de-interleaved
projections). Plain parameters take each write's value, dequantized if stored quantized; a
quantized module (models/quant/) takes the write with its scales (StoredWrite) and keeps the
stored format where it runs it, else quantizes into its own. A quantized weight's scales
arrive just before it (checkpoint_scales.py). Every parameter element must be written
exactly once, or loading fails naming what is missing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm import tqdm

from ninfer.models.causal_lm import CausalLM
from ninfer.models.checkpoint_scales import CheckpointScales
from ninfer.models.config import ModelConfig
from ninfer.models.layers.linear import packed_parts, rows_within
from ninfer.models.layers.moe import Experts
from ninfer.models.meta_build import meta_build, with_storage
from ninfer.models.quant.fp8 import FP8, SCALE_BLOCK, Fp8Linear, quantize_fp8_
from ninfer.models.quant.fp8_experts import PROJECTIONS, Fp8Experts
from ninfer.models.quant.nvfp4 import Nvfp4Linear, quantize_nvfp4_
from ninfer.models.quant.nvfp4_experts import Nvfp4Experts
from ninfer.models.quant.stored_write import StoredWrite, StoresCheckpointWrites
from ninfer.models.registry import CheckpointRule, checkpoint_rule, model_class
from ninfer.models.weight_load_error import WeightLoadError

if TYPE_CHECKING:
    from ninfer.parallel.shard_plan import ShardPlan

log = logging.getLogger(__name__)

QUANTIZE_AT_LOAD = {"fp8": quantize_fp8_, "nvfp4": quantize_nvfp4_}  # --quantize: the modules it converts


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    fp8_weights: dict[str, tuple[int, ...]] | None = None,
    nvfp4_weights: dict[str, tuple[int, ...]] | None = None,
    quantize: str | None = None,
    shard: ShardPlan | None = None,
) -> CausalLM:
    """An uninitialised model with storage allocated on `device` (no weights read).

    fp8_weights: stored names and shapes of block-scaled FP8 checkpoint weights; the Linear
    layers they fill become Fp8Linear (row-block scales) and the fused experts Fp8Experts
    (fp8_expert_layouts) before any storage is allocated.
    nvfp4_weights: likewise for NVFP4 checkpoint weights (their unpacked shapes) -> Nvfp4Linear
    and Nvfp4Experts.
    quantize: "fp8" | "nvfp4": then the modules quantize_fp8_ / quantize_nvfp4_ would convert
    (of those left) are built quantized and unfilled too, and load_weights quantizes each bf16
    weight into them as it arrives, so no quantized layer's bf16 weights are ever all held.
    shard: build one tensor-parallel rank's model (from shard.local_config; `config` is the whole
    model's, in whose terms the stored weights are named and shaped).
    """
    cls = model_class(config)
    with meta_build():
        model = cls(shard.local_config if shard is not None else config).to(dtype)
    placeholders = [(Fp8Linear, fp8_weights or {}), (Nvfp4Linear, nvfp4_weights or {})]
    for module_type, stored in placeholders:
        for module_name in sorted(fp8_linear_names(model, config, stored, shard)):
            _replace(model, module_name, module_type.placeholder)
    for module_name, rows_per_block in sorted(fp8_expert_layouts(model, config, fp8_weights or {}, shard).items()):
        _replace(model, module_name, lambda experts: Fp8Experts.placeholder(experts, rows_per_block))
    for module_name in sorted(expert_names(model, config, nvfp4_weights or {}, shard)):
        _replace(model, module_name, Nvfp4Experts.placeholder)
    if quantize is not None:
        if quantize not in QUANTIZE_AT_LOAD:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_AT_LOAD)}, not {quantize!r}")
        QUANTIZE_AT_LOAD[quantize](model, placeholders=True)
    return materialize(model, device)


def _replace(model: nn.Module, module_name: str, convert) -> None:
    parent_name, _, child_name = module_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, child_name, convert(getattr(parent, child_name)))


def materialize(model: CausalLM, device: torch.device | str) -> CausalLM:
    """A meta-device model with (uninitialised) storage on `device`: tied weights shared again,
    computed buffers (rotary tables) rebuilt there, since they are computed, not loaded."""
    model = with_storage(model, device)
    model.tie_weights()
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    return model


def fp8_linear_names(
    model: nn.Module, config: ModelConfig, fp8_weights: dict[str, tuple[int, ...]], shard: ShardPlan | None = None
) -> set[str]:
    """The Linear layers (packed or not) that stored quantized weights write into."""
    modules = dict(model.named_modules())
    names: set[str] = set()
    for param_name, _ in _stored_writes(model, config, fp8_weights, shard):
        module_name = param_name.removesuffix(".weight")
        if param_name.endswith(".weight") and isinstance(modules.get(module_name), nn.Linear):
            names.add(module_name)
    return names


def expert_names(
    model: nn.Module, config: ModelConfig, stored: dict[str, tuple[int, ...]], shard: ShardPlan | None = None
) -> set[str]:
    """The fused experts that stored quantized weights write into."""
    modules = dict(model.named_modules())
    names = {param_name.rpartition(".") for param_name, _ in _stored_writes(model, config, stored, shard)}
    return {module_name for module_name, _, projection in names
            if projection in PROJECTIONS and isinstance(modules.get(module_name), Experts)}  # fmt: skip


def fp8_expert_layouts(
    model: nn.Module, config: ModelConfig, fp8_weights: dict[str, tuple[int, ...]], shard: ShardPlan | None = None
) -> dict[str, int]:
    """Fused experts that stored FP8 weights write into -> weight rows per scale row: 128 (the
    checkpoint's 128 x 128 blocks, as stored) unless a stored part's rows start inside a block
    (per-expert gate and up with I not a multiple of 128, or a rank's share of them), then 1
    (row blocks)."""
    modules = dict(model.named_modules())
    layouts: dict[str, int] = {}
    for param_name, index in _stored_writes(model, config, fp8_weights, shard):
        module_name, _, projection = param_name.rpartition(".")
        if projection in PROJECTIONS and isinstance(modules.get(module_name), Experts):
            aligned = _first_row(index) % SCALE_BLOCK == 0 and layouts.get(module_name, SCALE_BLOCK) == SCALE_BLOCK
            layouts[module_name] = SCALE_BLOCK if aligned else 1
    return layouts


def _stored_writes(
    model: nn.Module, config: ModelConfig, stored: dict[str, tuple[int, ...]], shard: ShardPlan | None
) -> Iterator[tuple[str, object]]:
    """(parameter name, index) of each write the stored weights make in `model`, packed parts as
    their packed parameter's rows; with `shard`, the rank's own writes in its own terms."""
    rule = checkpoint_rule(config)
    packed = shard.full_packed_parts if shard is not None else packed_parts(model)
    for stored_name, shape in stored.items():
        for param_name, index, value in rule(stored_name, torch.empty(shape, dtype=FP8, device="meta"), config):
            if param_name in packed:
                packed_name, part_rows = packed[param_name]
                param_name, index = packed_name, rows_within(part_rows, index)
            write = StoredWrite(stored_name, param_name, index, value)
            for local in shard.localize(write) if shard is not None else (write,):
                yield local.param_name, local.index


def _first_row(index) -> int:
    """The first weight row of an expert write's index: None (all), an expert, or (expert, rows)."""
    if isinstance(index, tuple):
        return index[1].start or 0
    return 0


def load_weights(
    model: CausalLM,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    total: int | None = None,
    progress: bool = True,
    source: str = "checkpoint",
    rule: CheckpointRule | None = None,
    dtype: torch.dtype | None = None,
    shard: ShardPlan | None = None,
) -> None:
    """rule: how stored names map to parameters (default: the model family's checkpoint rule).
    dtype: the model's unquantized dtype. An unquantized weight bound for a quantized module is
    rounded to it (default: kept as stored), then quantized into the module as it arrives, on
    the module's device, a chunk of rows at a time (quant/row_chunks.py): the same bits as
    loading it unquantized and quantizing the loaded module.
    shard: `model` is one tensor-parallel rank's (built from shard.local_config): the rule maps
    stored tensors in the full model's terms, and each write keeps the rank's part of it."""
    rule = rule or checkpoint_rule(model.config)
    rule_config = shard.full_config if shard is not None else model.config
    params = dict(model.named_parameters())
    # Quantized weights are buffers of modules that store checkpoint writes themselves:
    # parameter name -> (module, weight's attribute).
    owners = {
        f"{module_name}.{attribute}": (module, attribute)
        for module_name, module in model.named_modules()
        if isinstance(module, StoresCheckpointWrites)
        for attribute in module.stored_weights
    }
    params.update({name: getattr(module, attribute) for name, (module, attribute) in owners.items()})
    # Tied parameters (lm_head.weight = embed_tokens.weight) appear once; a checkpoint may store both.
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - params.keys()
    packed = packed_parts(model)
    # Where each stored part's rows are in the packed parameter the rule's writes address.
    write_packed = shard.full_packed_parts if shard is not None else packed
    written = {name: 0 for name in params}
    parts_written: dict[str, int] = {}  # per stored part of a packed parameter, to name what is missing
    scales = CheckpointScales(source)
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress, leave=False)
    with torch.no_grad():
        for stored_name, tensor in tensors:
            bar.update(1)
            if scales.hold(stored_name, tensor):
                continue
            for write in scales.writes(stored_name, tensor, rule, rule_config):
                part = write.param_name if write.param_name in write_packed else None
                if part is not None:
                    packed_name, part_rows = write_packed[part]
                    write = replace(write, param_name=packed_name, index=rows_within(part_rows, write.index))
                for write in shard.localize(write) if shard is not None else (write,):
                    if part is not None:
                        parts_written[part] = parts_written.get(part, 0) + write.value.numel()
                    param = params.get(write.param_name)
                    if param is None and write.param_name in aliases:
                        continue
                    if param is None:
                        raise WeightLoadError(f"{write.what} maps to unknown parameter {write.param_name!r}")
                    module, attribute = owners.get(write.param_name, (None, None))
                    if module is None:
                        write.copy_dense_into(param)
                    else:
                        module.load_stored(attribute, write, dtype)
                    written[write.param_name] += write.target(param).numel()
    bar.close()
    _check_written_once(params, written, packed, parts_written, source)


def _check_written_once(
    params: dict[str, torch.Tensor],
    written: dict[str, int],
    packed: dict[str, tuple[str, slice]],
    parts_written: dict[str, int],
    source: str,
) -> None:
    """Every element of every parameter written exactly once, else a WeightLoadError naming which are not."""
    missing = [n for n, p in params.items() if written[n] < p.numel()]
    # Name a packed parameter's missing parts as the checkpoint calls them.
    for part, (packed_name, rows) in packed.items():
        if packed_name in missing and parts_written.get(part, 0) < (rows.stop - rows.start) * params[packed_name][0].numel():
            missing.append(part)
    missing = [n for n in missing if n not in {packed_name for packed_name, _ in packed.values()}]
    if missing:
        shown = ", ".join(missing[:8]) + (" …" if len(missing) > 8 else "")
        raise WeightLoadError(f"{source}: {len(missing)} parameters were not loaded: {shown}")
    over = [n for n, p in params.items() if written[n] > p.numel()]
    if over:
        raise WeightLoadError(f"{source}: parameters written more than once: {', '.join(over[:8])}")


def load_model(
    config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    total: int | None = None,
    progress: bool = True,
    source: str = "checkpoint",
    fp8_weights: dict[str, tuple[int, ...]] | None = None,
    nvfp4_weights: dict[str, tuple[int, ...]] | None = None,
    quantize: str | None = None,
    shard: ShardPlan | None = None,
) -> CausalLM:
    """fp8_weights, nvfp4_weights: see build_model; `tensors` then yields each such weight's
    scales (`<name>_scale_inv`; `<name>_scale` and `<name>_scale_2`) right before the weight.
    quantize: "fp8" | "nvfp4", quantized as the weights arrive (build_model).
    shard: build and fill one tensor-parallel rank's part of the model (`config` is the full one)."""
    dtype = dtype or getattr(torch, config.torch_dtype, torch.bfloat16)
    model = build_model(config, dtype, device, fp8_weights, nvfp4_weights, quantize, shard)
    load_weights(model, tensors, total=total, progress=progress, source=source, dtype=dtype, shard=shard)
    model.eval()
    return model


def iter_state_dict(state_dict: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Feed an in-memory state dict (e.g. a transformers model's) through the same rules."""
    yield from state_dict.items()
