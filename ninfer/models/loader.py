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
from tqdm import tqdm

from ninfer.models.causal_lm import CausalLM
from ninfer.models.config import ModelConfig
from ninfer.models.layers.linear import packed_parts, rows_within
from ninfer.models.registry import checkpoint_rule, model_class

log = logging.getLogger(__name__)


class WeightLoadError(ValueError):
    """The checkpoint's tensors do not fill the model exactly."""


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> CausalLM:
    """An uninitialised model with storage allocated on `device` (no weights read)."""
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    # Buffers (rotary tables) are computed, not loaded: rebuild them on the real device.
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    return model


def load_weights(
    model: CausalLM,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    total: int | None = None,
    progress: bool = True,
    source: str = "checkpoint",
) -> None:
    rule = checkpoint_rule(model.config)
    params = dict(model.named_parameters())
    # Tied parameters (lm_head.weight = embed_tokens.weight) appear once; a checkpoint may store both.
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - params.keys()
    packed = packed_parts(model)
    written = {name: 0 for name in params}
    parts_written: dict[str, int] = {}  # per stored part of a packed parameter, to name what is missing
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress, leave=False)
    with torch.no_grad():
        for stored_name, tensor in tensors:
            for param_name, index, value in rule(stored_name, tensor, model.config):
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
                if tuple(target.shape) != tuple(value.shape):
                    raise WeightLoadError(
                        f"{source}: tensor {stored_name!r} has shape {tuple(value.shape)}, "
                        f"parameter {param_name!r}{'' if index is None else f'[{index}]'} "
                        f"expects {tuple(target.shape)}"
                    )
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


def load_model(
    config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    total: int | None = None,
    progress: bool = True,
    source: str = "checkpoint",
) -> CausalLM:
    dtype = dtype or getattr(torch, config.torch_dtype, torch.bfloat16)
    model = build_model(config, dtype, device)
    load_weights(model, tensors, total=total, progress=progress, source=source)
    model.eval()
    return model


def iter_state_dict(state_dict: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Feed an in-memory state dict (e.g. a transformers model's) through the same rules."""
    yield from state_dict.items()
