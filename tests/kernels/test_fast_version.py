"""kernels/backend.py: fast versions held to their reference's arguments, and size-gated dispatch."""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels import backend
from ninfer.kernels.backend import dispatched, fast_version


def scale_rows(x: torch.Tensor, factor: float = 2.0, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: x * factor."""
    return x * factor


def test_fast_version_takes_the_reference_annotations():
    @fast_version(scale_rows)
    def fast(x, factor=2.0, *, out=None, block: int = 64):
        return x * factor

    assert fast.__annotations__["x"] == "torch.Tensor"
    assert fast.__annotations__["return"] == "torch.Tensor"
    assert fast.__annotations__["block"] == "int"


@pytest.mark.parametrize(
    "source",
    [
        "def fast(x, factor=3.0, *, out=None): ...",  # another default
        "def fast(x, scale=2.0, *, out=None): ...",  # another name
        "def fast(x, factor=2.0): ...",  # a parameter missing
        "def fast(x, factor=2.0, *, out=None, block=64, **hints): ...",  # a catch-all past them
        "def fast(x, factor=2.0, block=64, *, out=None): ...",  # an extra positional
    ],
)
def test_fast_version_refuses_other_arguments(source):
    namespace: dict = {}
    exec(source, namespace)
    with pytest.raises(TypeError, match="does not take the arguments of"):
        fast_version(scale_rows)(namespace["fast"])


def test_dispatched_asks_fast_when(monkeypatch):
    calls = []
    monkeypatch.setattr(backend, "fast_impl", lambda package, name, tensor: lambda x, *a, **k: calls.append(x) or x)
    op = dispatched("ninfer.kernels.gemv", scale_rows, fast_when=lambda x: x.shape[0] <= 2)
    small, large = torch.ones(2, 3), torch.ones(3, 3)
    assert op(small) is small and calls == [small]
    assert torch.equal(op(large), large * 2.0) and calls == [small]
