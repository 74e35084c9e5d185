"""Dispatch between an op's reference and its fast implementations (triton.py on CUDA, cpu.py on CPU).

An op's signature and contract are written once, in its ref.py; `dispatched` turns that reference
into the public op, and `fast_version` holds each fast version to the same arguments.
"""

from __future__ import annotations

import functools
import importlib
import inspect
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


def dispatched(
    package: str, reference: Callable, fast_when: Callable[[torch.Tensor], bool] | None = None
) -> Callable:
    """The public op `package.<reference's name>`: the reference's signature and docstring, run by
    the fast version for CUDA tensors, the CPU version for CPU tensors where cpu.py has one, else by
    the reference itself. The first tensor argument decides (every op's first argument is one);
    fast_when, if given, must also accept it for the fast version to run (a size it is built for)."""
    name = reference.__name__

    @functools.wraps(reference)
    def op(*args, **kwargs):
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else _first_tensor(args, kwargs)
        fast = fast_impl(package, name, tensor) if fast_when is None or fast_when(tensor) else None
        impl = fast or cpu_impl(package, name, tensor) or reference
        return impl(*args, **kwargs)

    return op


def fast_version(reference: Callable) -> Callable[[Callable], Callable]:
    """Declares the decorated function (in triton.py or cpu.py) the fast version of `reference`,
    whose annotations and docstring are the contract: the fast version names its parameters
    without types and documents only what differs. Checked at import: the reference's parameters
    in order, of the same kinds and defaults; any past them are keyword-only launch overrides."""

    def declare(fast: Callable) -> Callable:
        expected = list(inspect.signature(reference).parameters.values())
        actual = list(inspect.signature(fast).parameters.values())
        differing = [
            f.name
            for r, f in zip(expected, actual)
            if (r.name, r.kind) != (f.name, f.kind) or (r.default is not f.default and r.default != f.default)
        ]
        extras = [p.name for p in actual[len(expected) :] if p.kind is not p.KEYWORD_ONLY]
        if len(actual) < len(expected) or differing or extras:
            raise TypeError(
                f"{fast.__module__}.{fast.__qualname__} does not take the arguments of "
                f"{reference.__module__}.{reference.__qualname__} (at {differing + extras or 'its end'})"
            )
        fast.__annotations__ = {**reference.__annotations__, **fast.__annotations__}
        return fast

    return declare


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError("a kernel op needs at least one tensor argument")
