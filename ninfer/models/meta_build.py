"""Modules built on the meta device without their random initialisation.

A model is built on the meta device and then filled from its checkpoint, so the modules' own
initialisation is wasted work there, and not free: `normal_` on a meta tensor (nn.Embedding's)
runs torch's Python reference under a `torch._dynamo` guard, whose first import costs seconds
of a server's start (torch's compiler stack, all of it Python). Only meta tensors are skipped:
a module built on a real device in the same block keeps its initialisation. with_storage then
gives a built model its storage, except in a dry run, which stays on meta.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

M = TypeVar("M", bound=nn.Module)

# The in-place fills nn modules' reset_parameters reach (directly or through torch.nn.init).
_INIT_FUNCTIONS = frozenset({
    torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.trunc_normal_, torch.nn.init.kaiming_uniform_,
    torch.nn.init.kaiming_normal_, torch.nn.init.xavier_uniform_, torch.nn.init.xavier_normal_,
    torch.nn.init.zeros_, torch.nn.init.ones_, torch.nn.init.constant_,
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_,
})


class _SkipMetaInit(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INIT_FUNCTIONS:
            # torch.nn.init passes its tensor by keyword, Tensor methods as self.
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextmanager
def meta_build() -> Iterator[None]:
    """Within: new tensors are on the meta device and left unfilled."""
    with torch.device("meta"), _SkipMetaInit():
        yield


def with_storage(module: M, device: torch.device | str) -> M:
    """A meta-built module with (uninitialised) storage on `device`; a dry run's (device meta)
    stays as built: to_empty on meta runs torch's Python references too."""
    if torch.device(device).type == "meta":
        return module
    return module.to_empty(device=device)
