"""Dispatch between an op's reference and its fast implementations (triton.py on CUDA, cpu.py on CPU)."""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch


def _force_ref() -> bool:
    return os.environ.get("NINFER_KERNELS", "auto") == "ref"


@functools.cache
def _fast_module(package: str, backend: str = "triton") -> ModuleType | None:
    try:
        return importlib.import_module(f"{package}.{backend}")
    except ImportError:
        return None


def fast_impl(package: str, name: str, tensor: torch.Tensor):
    """The fast version of `package.name` for this tensor, or None to use ref.py."""
    if not tensor.is_cuda or _force_ref():
        return None
    module = _fast_module(package)
    return getattr(module, name, None) if module is not None else None


def cpu_impl(package: str, name: str, tensor: torch.Tensor):
    """The CPU version of `package.name` (its cpu.py) for this CPU tensor, or None to use ref.py."""
    if tensor.device.type != "cpu" or _force_ref():
        return None
    module = _fast_module(package, "cpu")
    return getattr(module, name, None) if module is not None else None
