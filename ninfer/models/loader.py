"""Build a model on the meta device and fill it from checkpoint tensors.

Loading stays outside the model files: each family's checkpoint rule (registry.py) maps
stored tensors to parameter writes, possibly slices (fused experts, de-interleaved
projections). Every parameter element must be written exactly once, or loading fails
naming what is missing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from tqdm import tqdm

from ninfer.models.causal_lm import CausalLM
from ninfer.models.config import ModelConfig
from ninfer.models.layers.linear import packed_parts, rows_within
from ninfer.models.layers.moe import Experts
from ninfer.kernels.nvfp4_gemv import dequantize_nvfp4
from ninfer.models.quant.fp8 import FP8, SCALE_BLOCK, Fp8Linear, expand_block_rows, quantize_blocks, quantize_fp8_
from ninfer.models.quant.fp8_experts import PROJECTIONS, Fp8Experts
from ninfer.models.quant.nvfp4 import Nvfp4Linear, quantize_nvfp4_
from ninfer.models.registry import CheckpointRule, checkpoint_rule, model_class
from ninfer.models.weight_load_error import WeightLoadError

log = logging.getLogger(__name__)

QUANTIZE_AT_LOAD = {"fp8": quantize_fp8_, "nvfp4": quantize_nvfp4_}  # --quantize: the modules it converts

FP8_SCALE_SUFFIX = "_scale_inv"  # Qwen FP8 checkpoints: "<weight name>_scale_inv" holds its block scales
# ModelOpt NVFP4 checkpoints: "<weight name>_scale" (e4m3 per 16 values) and "<weight name>_scale_2"
# (the tensor's fp32 global scale) accompany each uint8 weight of packed e2m1 codes.
NVFP4_BLOCK_SUFFIX = "_scale"
NVFP4_GLOBAL_SUFFIX = "_scale_2"


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    fp8_weights: dict[str, tuple[int, ...]] | None = None,
    nvfp4_weights: dict[str, tuple[int, ...]] | None = None,
    quantize: str | None = None,
) -> CausalLM:
    """An uninitialised model with storage allocated on `device` (no weights read).

    fp8_weights: stored names and shapes of block-scaled FP8 checkpoint weights; the Linear
    layers they fill become Fp8Linear (row-block scales) and the fused experts Fp8Experts
    (fp8_expert_layouts) before any storage is allocated.
    nvfp4_weights: likewise for NVFP4 checkpoint weights (their unpacked shapes) -> Nvfp4Linear.
    quantize: "fp8" | "nvfp4": then the modules quantize_fp8_ / quantize_nvfp4_ would convert
    (of those left) are built quantized and unfilled too, and load_weights quantizes each bf16
    weight into them as it arrives, so no quantized layer's bf16 weights are ever all held.
    """
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config).to(dtype)
    placeholders = [(Fp8Linear, fp8_weights or {}), (Nvfp4Linear, nvfp4_weights or {})]
    for module_type, stored in placeholders:
        for module_name in sorted(fp8_linear_names(model, config, stored)):
            _replace(model, module_name, module_type.placeholder)
    for module_name, rows_per_block in sorted(fp8_expert_layouts(model, config, fp8_weights or {}).items()):
        _replace(model, module_name, lambda experts: Fp8Experts.placeholder(experts, rows_per_block))
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
    model = model.to_empty(device=device)
    model.tie_weights()
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    return model


def fp8_linear_names(model: nn.Module, config: ModelConfig, fp8_weights: dict[str, tuple[int, ...]]) -> set[str]:
    """The Linear layers (packed or not) that stored quantized weights write into."""
    modules = dict(model.named_modules())
    names: set[str] = set()
    for param_name, _ in _stored_writes(model, config, fp8_weights):
        module_name = param_name.removesuffix(".weight")
        if param_name.endswith(".weight") and isinstance(modules.get(module_name), nn.Linear):
            names.add(module_name)
    return names


def fp8_expert_layouts(model: nn.Module, config: ModelConfig, fp8_weights: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Fused experts that stored FP8 weights write into -> weight rows per scale row: 128 (the
    checkpoint's 128 x 128 blocks, as stored) unless a stored part's rows start inside a block
    (per-expert gate and up with I not a multiple of 128), then 1 (row blocks)."""
    modules = dict(model.named_modules())
    layouts: dict[str, int] = {}
    for param_name, index in _stored_writes(model, config, fp8_weights):
        module_name, _, projection = param_name.rpartition(".")
        if projection in PROJECTIONS and isinstance(modules.get(module_name), Experts):
            aligned = _first_row(index) % SCALE_BLOCK == 0 and layouts.get(module_name, SCALE_BLOCK) == SCALE_BLOCK
            layouts[module_name] = SCALE_BLOCK if aligned else 1
    return layouts


def _stored_writes(model: nn.Module, config: ModelConfig, stored: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, object]]:
    """(parameter name, index) of each write the stored weights make, packed parts as their packed parameter."""
    rule = checkpoint_rule(config)
    packed = packed_parts(model)
    for stored_name, shape in stored.items():
        for param_name, index, _ in rule(stored_name, torch.empty(shape, dtype=FP8, device="meta"), config):
            yield packed.get(param_name, (param_name, None))[0], index


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
) -> None:
    """rule: how stored names map to parameters (default: the model family's checkpoint rule).
    dtype: the model's unquantized dtype. An unquantized weight bound for a quantized module is
    rounded to it (default: kept as stored), then quantized into the module as it arrives, on
    the module's device, a chunk of rows at a time (quant/row_chunks.py): the same bits as
    loading it unquantized and quantizing the loaded module."""
    rule = rule or checkpoint_rule(model.config)
    params = dict(model.named_parameters())
    # Quantized weights are buffers of their modules: parameter name -> (module, weight's attribute).
    quantized: dict[str, tuple[nn.Module, str]] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, (Fp8Linear, Nvfp4Linear)):
            quantized[f"{module_name}.weight"] = (module, "weight")
        elif isinstance(module, Fp8Experts):
            quantized.update({f"{module_name}.{projection}": (module, projection) for projection in PROJECTIONS})
    params.update({name: getattr(module, attribute) for name, (module, attribute) in quantized.items()})
    pending_scales: dict[str, torch.Tensor] = {}  # a block-scaled FP8 weight's scales arrive just before it
    pending_nvfp4: dict[str, dict[str, torch.Tensor]] = {}  # an NVFP4 weight's two scales, likewise
    # Tied parameters (lm_head.weight = embed_tokens.weight) appear once; a checkpoint may store both.
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - params.keys()
    packed = packed_parts(model)
    written = {name: 0 for name in params}
    parts_written: dict[str, int] = {}  # per stored part of a packed parameter, to name what is missing
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress, leave=False)
    with torch.no_grad():
        for stored_name, tensor in tensors:
            if stored_name.endswith(FP8_SCALE_SUFFIX):
                pending_scales[stored_name.removesuffix(FP8_SCALE_SUFFIX)] = tensor
                bar.update(1)
                continue
            nvfp4_suffix = _nvfp4_scale_suffix(stored_name)
            if nvfp4_suffix is not None:
                pending_nvfp4.setdefault(stored_name.removesuffix(nvfp4_suffix), {})[nvfp4_suffix] = tensor
                bar.update(1)
                continue
            if tensor.dtype == torch.uint8 and stored_name in pending_nvfp4:
                _load_nvfp4(stored_name, tensor, pending_nvfp4.pop(stored_name), model, rule, params, packed,
                            quantized, written, parts_written, source, dtype)
                bar.update(1)
                continue
            row_scales: list | None = None
            if tensor.dtype == FP8:
                block_scale = pending_scales.pop(stored_name, None)
                if block_scale is None:
                    raise WeightLoadError(
                        f"{source}: FP8 tensor {stored_name!r} has no {FP8_SCALE_SUFFIX} scales before it"
                    )
                # Row-wise scales follow the rule's row slicing exactly as the weight does.
                per_row = expand_block_rows(block_scale, tensor.shape[-2])
                row_scales = [scales for _, _, scales in rule(stored_name, per_row, model.config)]
            for write, (param_name, index, value) in enumerate(rule(stored_name, tensor, model.config)):
                value_scales = None if row_scales is None else row_scales[write]
                if param_name in packed:
                    parts_written[param_name] = parts_written.get(param_name, 0) + value.numel()
                    param_name, part_rows = packed[param_name]
                    index = rows_within(part_rows, index)
                param = params.get(param_name)
                if param is None and param_name in aliases:
                    continue
                if param is None:
                    raise WeightLoadError(f"{source}: tensor {stored_name!r} maps to unknown parameter {param_name!r}")
                target = param if index is None else param[index]
                owner = quantized.get(param_name)
                module, attribute = owner or (None, None)
                what = f"{source}: tensor {stored_name!r}"
                if value_scales is not None and not _keeps_fp8_blocks(module, attribute):
                    # FP8 stored, unquantized here (a model built without FP8 modules): dequantize exactly.
                    columns = value_scales.repeat_interleave(SCALE_BLOCK, dim=-1)[..., : value.shape[-1]]
                    value, value_scales = value.float() * columns, None
                if value_scales is None and owner is not None:
                    # Unquantized, for a quantized module (--quantize, or a part stored unquantized
                    # beside quantized ones): quantized into it now.
                    _quantize_arriving(owner, index, target, value, dtype, what, param_name)
                    written[param_name] += target.numel()
                    continue
                if tuple(target.shape) != tuple(value.shape):
                    raise WeightLoadError(
                        f"{what} has shape {tuple(value.shape)}, "
                        f"parameter {param_name!r}{'' if index is None else f'[{index}]'} "
                        f"expects {tuple(target.shape)}"
                    )
                if isinstance(module, Fp8Experts):
                    _load_fp8_experts(module, attribute, index, target, value, value_scales, what)
                elif isinstance(module, Fp8Linear):
                    target.copy_(value)
                    (module.weight_scale if index is None else module.weight_scale[index]).copy_(value_scales)
                else:
                    target.copy_(value)
                written[param_name] += value.numel()
            bar.update(1)
    bar.close()
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


def _keeps_fp8_blocks(module: nn.Module | None, attribute: str | None) -> bool:
    """Whether a stored FP8 weight's block scales go into `module` as they are."""
    if isinstance(module, Fp8Linear):
        return module.block_scaled
    return isinstance(module, Fp8Experts) and module.rows_per_block(attribute) is not None


def _quantize_arriving(
    owner: tuple[nn.Module, str],
    index,
    target: torch.Tensor,
    value: torch.Tensor,
    dtype: torch.dtype | None,
    what: str,
    param_name: str,
) -> None:
    """Quantize an unquantized weight (or its rows at `index`) into its quantized module's layout."""
    module, attribute = owner
    expected = tuple(target.shape)
    if isinstance(module, Nvfp4Linear):
        expected = (*target.shape[:-1], target.shape[-1] * 2)  # two codes a byte
    if tuple(value.shape) != expected:
        raise WeightLoadError(
            f"{what} has shape {tuple(value.shape)}, "
            f"parameter {param_name!r}{'' if index is None else f'[{index}]'} expects {expected}"
        )
    if isinstance(module, Fp8Experts) and module.rows_per_block(attribute) == SCALE_BLOCK:
        # 128 x 128 blocks span rows, so this one is quantized whole (an expert of a mixed checkpoint).
        _load_fp8_experts(module, attribute, index, target, value.to(dtype or value.dtype), None, what)
    elif isinstance(module, Fp8Experts):
        module.quantize_into(attribute, index, value, dtype)
    else:
        module.quantize_into(index, value, dtype)


def _load_fp8_experts(
    module: Fp8Experts,
    projection: str,
    index,
    target: torch.Tensor,
    value: torch.Tensor,
    row_scales: torch.Tensor | None,
    source: str,
) -> None:
    """One write into FP8 experts with block scales: the stored e4m3 bits and their block scales
    (row_scales: expanded per row) in the module's layout, row blocks or 128 x 128 blocks (their
    slice of the fused scales). An unquantized tensor (row_scales None) is quantized into that layout."""
    rows_per_block = module.rows_per_block(projection)
    if rows_per_block is None:
        raise WeightLoadError(f"{source}: stored FP8 block scales for {projection}, whose scales here are per row")
    scale_index = index if rows_per_block == 1 else _block_index(index, source)
    if row_scales is None:
        value, scales = quantize_blocks(value, rows_per_block)
    else:  # a write starting on a block's first row: every 128th row is the next block's scales
        scales = row_scales[..., ::rows_per_block, :]
    scale = module.scale_of(projection)
    scale_target = scale if scale_index is None else scale[scale_index]
    if tuple(scale_target.shape) != tuple(scales.shape):
        raise WeightLoadError(
            f"{source} has scales of shape {tuple(scales.shape)} for {projection}, whose scales there "
            f"take {tuple(scale_target.shape)}"
        )
    target.copy_(value)
    scale_target.copy_(scales)


def _block_index(index, source: str):
    """An expert write's index into the weight [E, N, K] -> into its 128 x 128 block scales."""
    if not isinstance(index, tuple):
        return index  # all experts, or one
    expert, rows = index
    first = rows.start or 0
    if first % SCALE_BLOCK:
        raise WeightLoadError(f"{source}: its rows from {first} do not start a {SCALE_BLOCK}-row scale block")
    return expert, slice(first // SCALE_BLOCK, -(-rows.stop // SCALE_BLOCK))


def _nvfp4_scale_suffix(stored_name: str) -> str | None:
    for suffix in (NVFP4_GLOBAL_SUFFIX, NVFP4_BLOCK_SUFFIX):
        if stored_name.endswith(".weight" + suffix):
            return suffix
    return None


def _load_nvfp4(
    stored_name: str,
    codes: torch.Tensor,
    scales: dict[str, torch.Tensor],
    model: CausalLM,
    rule: CheckpointRule,
    params: dict[str, torch.Tensor],
    packed: dict[str, tuple[str, slice]],
    quantized: dict[str, tuple[nn.Module, str]],
    written: dict[str, int],
    parts_written: dict[str, int],
    source: str,
    dtype: torch.dtype | None,
) -> None:
    """Write one NVFP4 checkpoint weight: as stored into an Nvfp4Linear (its global scale becomes
    the rows' scale), else dequantized exactly (MoE experts, or a model built without NVFP4),
    and quantized again if its module is quantized in another format (--quantize fp8)."""
    if NVFP4_BLOCK_SUFFIX not in scales or NVFP4_GLOBAL_SUFFIX not in scales:
        missing = NVFP4_BLOCK_SUFFIX if NVFP4_BLOCK_SUFFIX not in scales else NVFP4_GLOBAL_SUFFIX
        raise WeightLoadError(f"{source}: NVFP4 weight {stored_name!r} has no {stored_name}{missing} before it")
    block_scale = scales[NVFP4_BLOCK_SUFFIX]
    if block_scale.shape != (*codes.shape[:-1], codes.shape[-1] * 2 // 16):
        raise WeightLoadError(
            f"{source}: NVFP4 weight {stored_name!r} {list(codes.shape)} has block scales "
            f"{list(block_scale.shape)}; expected {[*codes.shape[:-1], codes.shape[-1] * 2 // 16]}"
        )
    row_scale = scales[NVFP4_GLOBAL_SUFFIX].float().reshape(-1)[:1].expand(codes.shape[:-1]).unsqueeze(-1)
    # The scales follow the rule's row slicing exactly as the codes do.
    block_parts = [value for _, _, value in rule(stored_name, block_scale, model.config)]
    row_parts = [value for _, _, value in rule(stored_name, row_scale, model.config)]
    for write, (param_name, index, value) in enumerate(rule(stored_name, codes, model.config)):
        if param_name in packed:
            parts_written[param_name] = parts_written.get(param_name, 0) + value.numel()
            param_name, part_rows = packed[param_name]
            index = rows_within(part_rows, index)
        param = params.get(param_name)
        if param is None:
            raise WeightLoadError(f"{source}: tensor {stored_name!r} maps to unknown parameter {param_name!r}")
        target = param if index is None else param[index]
        owner = quantized.get(param_name)
        module = owner[0] if owner is not None and isinstance(owner[0], Nvfp4Linear) else None
        if module is not None:
            if tuple(target.shape) != tuple(value.shape):
                raise WeightLoadError(
                    f"{source}: NVFP4 tensor {stored_name!r} has shape {tuple(value.shape)}, "
                    f"parameter {param_name!r} expects {tuple(target.shape)}"
                )
            target.copy_(value)
            (module.block_scale if index is None else module.block_scale[index]).copy_(block_parts[write])
            (module.row_scale if index is None else module.row_scale[index]).copy_(row_parts[write].reshape(-1))
        else:
            flat_codes = value.reshape(-1, value.shape[-1])
            dense = dequantize_nvfp4(
                flat_codes, block_parts[write].reshape(flat_codes.shape[0], -1), row_parts[write].reshape(-1)
            ).reshape(*value.shape[:-1], value.shape[-1] * 2)
            if owner is not None:
                _quantize_arriving(owner, index, target, dense, dtype, f"{source}: tensor {stored_name!r}", param_name)
            elif tuple(target.shape) != tuple(dense.shape):
                raise WeightLoadError(
                    f"{source}: tensor {stored_name!r} has shape {tuple(dense.shape)}, "
                    f"parameter {param_name!r} expects {tuple(target.shape)}"
                )
            else:
                target.copy_(dense)
        written[param_name] += value.numel() if module is not None else target.numel()


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
) -> CausalLM:
    """fp8_weights, nvfp4_weights: see build_model; `tensors` then yields each such weight's
    scales (`<name>_scale_inv`; `<name>_scale` and `<name>_scale_2`) right before the weight.
    quantize: "fp8" | "nvfp4", quantized as the weights arrive (build_model)."""
    dtype = dtype or getattr(torch, config.torch_dtype, torch.bfloat16)
    model = build_model(config, dtype, device, fp8_weights, nvfp4_weights, quantize)
    load_weights(model, tensors, total=total, progress=progress, source=source, dtype=dtype)
    model.eval()
    return model


def iter_state_dict(state_dict: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Feed an in-memory state dict (e.g. a transformers model's) through the same rules."""
    yield from state_dict.items()
