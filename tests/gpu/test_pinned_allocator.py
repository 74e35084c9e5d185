"""Buffers pinned through the register path (configure_pinned_allocator, as an engine process
sets it) are page-locked and carry bytes both ways like the default allocator's."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# A fresh process: the allocator setting is process-wide and is read at the first pinned allocation.
_SCRIPT = """
import torch
from ninfer.engine.pinned_allocator import configure_pinned_allocator
torch.zeros(1, device="cuda")
configure_pinned_allocator()
host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
assert host.is_pinned()
data = torch.randint(0, 256, host.shape, dtype=torch.uint8, device="cuda")
host.copy_(data, non_blocking=True)
back = host.to("cuda", non_blocking=True)
torch.cuda.synchronize()
assert torch.equal(back, data)
print("ok")
"""


def test_register_path_pins_and_copies_both_ways():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
