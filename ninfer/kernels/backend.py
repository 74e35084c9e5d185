"""Dispatch between an op's reference and its fast implementations (triton.py on CUDA, cpu.py on CPU).

An op's signature and contract are written once, in its ref.py; `dispatched` turns that reference
into the public op, and the fast versions take the same arguments.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from types import ModuleType

import torch


def persist_compile_caches(cache_root) -> None:
    """Keep Triton's compiled kernels and its autotuning results under cache_root across restarts
    (autotuning results are not kept by default, so every start re-benchmarked each config).
    Call before the first fast op: Triton's autotuners read the setting when their module loads.
    Variables the user set win."""
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(cache_root, "triton"))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")


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


def dispatched(package: str, reference: Callable) -> Callable:
    """The public op `package.<reference's name>`: the reference's signature and docstring, run by
    the fast version for CUDA tensors, the CPU version for CPU tensors where cpu.py has one, else by
    the reference itself. The first tensor argument decides (every op's first argument is one)."""
    name = reference.__name__

    @functools.wraps(reference)
    def op(*args, **kwargs):
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else _first_tensor(args, kwargs)
        impl = fast_impl(package, name, tensor) or cpu_impl(package, name, tensor) or reference
        return impl(*args, **kwargs)

    return op


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError("a kernel op needs at least one tensor argument")
