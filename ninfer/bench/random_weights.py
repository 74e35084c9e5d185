"""Deterministic random weights filled by parameter name, so two implementations get identical ones.

Realistic magnitudes (never zeros, which run faster than real data and hide bugs): matrices
N(0, fan_in^-1/2); zero-centred norm weights N(0, 0.1); plain norm weights N(1, 0.1);
A_log = log U(1, 16); dt_bias N(0, 0.5); conv weights N(0, 0.5).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ninfer.models.config import ModelConfig
from ninfer.models.layers.linear import packed_parts
from ninfer.models.loader import build_model


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def stored_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every parameter, packed projections split into their parts (views)."""
    parts_of: dict[str, list[tuple[str, slice]]] = {}
    for stored_name, (packed_name, rows) in packed_parts(model).items():
        parts_of.setdefault(packed_name, []).append((stored_name, rows))
    for name, param in model.named_parameters():
        if name in parts_of:
            for stored_name, rows in parts_of[name]:
                yield stored_name, param[rows]
        else:
            yield name, param


@torch.no_grad()
def fill_random_(named_parameters: Iterable[tuple[str, torch.Tensor]], seed: int = 0) -> None:
    """Pass `stored_parameters(model)` for our models, so packed parts get their checkpoint name's values."""
    for name, param in named_parameters:
        param.copy_(random_values(name, param.shape, param.dtype, param.device, seed))


def random_values(
    name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> torch.Tensor:
    """The values fill_random_ writes into the parameter `name` of this shape, dtype and device."""
    gen = torch.Generator(device=device).manual_seed(_seed(seed, name))
    if name.endswith("A_log"):
        values = torch.empty(shape, device=device, dtype=torch.float32).uniform_(1.0, 16.0, generator=gen).log()
    elif name.endswith("dt_bias"):
        values = torch.randn(shape, device=device, generator=gen) * 0.5
    elif "conv1d" in name:
        values = torch.randn(shape, device=device, generator=gen) * 0.5
    elif name.endswith("linear_attn.norm.weight"):
        values = 1.0 + torch.randn(shape, device=device, generator=gen) * 0.1
    elif len(shape) == 1:
        values = torch.randn(shape, device=device, generator=gen) * 0.1
    else:
        fan_in = shape[-1]
        values = torch.randn(shape, device=device, dtype=dtype, generator=gen) * (1.0 / math.sqrt(fan_in))
    return values.to(dtype)


def random_tensors(
    config: ModelConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of fill_random_'s values for the model `config` builds, made one
    at a time on `device`: loaded through loader.load_weights they give the model fill_random_
    fills, and a model quantized at load never holds more than one of them unquantized."""
    model = build_model(config, dtype, "meta")
    for name, param in stored_parameters(model):
        yield name, random_values(name, param.shape, param.dtype, torch.device(device), seed)
