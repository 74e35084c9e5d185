"""CPU installs may have torch without triton: everything outside the kernels' triton.py
modules (which the dispatcher imports lazily, for CUDA tensors) must import and run without it."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["triton"] = None  # any `import triton` now fails
import torch
from ninfer.kernels import activation, attention_prep, causal_conv1d, gated_delta_rule, gemv, moe
from ninfer.kernels import paged_attention, rms_norm, rotary
from ninfer.models import registry
x = torch.randn(3, 8)
print(rms_norm.rms_norm(x, torch.ones(8), 1e-6, False).shape)
"""


def test_ops_import_and_run_without_triton() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "torch.Size([3, 8])" in result.stdout
