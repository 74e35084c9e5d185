"""Programmatic dependent launch (Hopper and later) for the kernels of a decode step.

A decode step is a chain of ~700 short kernels; between two of them the GPU idles for
about a microsecond while the next grid launches. With PDL the next kernel is launched
while the previous one drains: its programs start, then wait in `gdc_wait()` until the
previous grid has completed and its writes are visible. Kernels that take USE_PDL call
`pdl_sync()` before their first load of anything an earlier kernel wrote.
NINFER_PDL=0 turns it off (A/B measurements, debugging).

Loads that may come before pdl_sync: what the previous launch cannot be writing. A program
of kernel N starts only after every program of kernel N-1 has passed its own pdl_sync, so
kernels N-2 and earlier are complete and their writes visible; only N-1 may still run.
Weights (never written during a step) and state that only the same kernel writes (one step
earlier: the GDN recurrent and conv states) are loaded before the wait by the norms, the
conv update, the recurrent kernel and the GEMV's first weight tile, so that their HBM
latency overlaps the previous kernel. Stores never come before the wait.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(tensor: torch.Tensor) -> bool:
    """Launch with PDL: a CUDA tensor on sm_90+, not under the CPU interpreter, not disabled."""
    if not tensor.is_cuda or os.environ.get("NINFER_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    return _supported(index)


@triton.jit
def pdl_sync(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel launch early.

    The dependents only get SM slots once every program of this grid has started, so they
    never delay this grid; they spin in their own pdl_sync until it completes.
    """
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
