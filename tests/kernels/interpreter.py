"""Running our Triton kernels under Triton's CPU interpreter, for the *_triton.py tests.

Import this module first: it skips the calling test module when triton is absent or a GPU
is present (tests/gpu covers the compiled kernels there).
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # the kernel modules import it; the interpreter needs no GPU
if torch.cuda.is_available():
    pytest.skip(
        "interpreter tests run on CPU-only machines; tests/gpu covers the compiled kernels", allow_module_level=True
    )


def interpreted(module_name: str):
    """Import a kernel module with its @triton.jit functions built for the CPU interpreter."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    sys.modules.pop(module_name, None)
    try:
        return importlib.import_module(module_name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


@pytest.fixture(autouse=True)
def cpu_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make Triton 3.6's interpreter run our kernels in a process that imported triton normally.

    - triton.language's own helpers (tl.sum, tl.max, tl.sigmoid ...) are @jit functions
      built when triton was first imported (here, usually by transformers -> fla, not in
      interpreter mode); calls to them from interpreted code go to an interpreted copy,
      and the language patches such a call makes are undone when it returns.
    - The interpreter keeps scalars as 1-element arrays and converts them with int(), which
      numpy >= 2.4 refuses; loops over runtime bounds need the element itself.
    """
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    compiled: dict = {}

    def call(self, *args, **kwargs):
        if self.fn not in compiled:
            compiled[self.fn] = interpreter.InterpretedFunction(self.fn)
        # InterpretedFunction.__call__ patches triton.language for the helper and never restores
        # it; the leaked patches break later compilations (tests/kernels/test_pdl_launch.py).
        scope = interpreter._patch_lang(self.fn)
        try:
            return compiled[self.fn](*args, **kwargs)
        finally:
            scope.restore()

    monkeypatch.setattr(JITFunction, "__call__", call)
    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)


@pytest.fixture
def bf16_round_to_nearest_even(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 -> bf16 in the interpreter as on the GPU (cvt.rn.bf16.f32) and in torch."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.array(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return original(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)


@pytest.fixture
def fp8e4nv_round_to_nearest_even(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 -> e4m3 in the interpreter as on the GPU (cvt.rn.satfinite.e4m3x2.f32) and in torch:
    Triton 3.6's interpreter rounds the mantissa without carrying into the exponent (124.7
    becomes 64, not 128)."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            values = torch.from_numpy(np.array(src.data, dtype=np.float32)).clamp(-448.0, 448.0)  # satfinite
            return interpreter.TensorHandle(values.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), tl.float8e4nv)
        return original(self, src, dst_type, rounding_mode)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)
