"""torch's pinned host allocator set to pin large buffers on several threads.

An engine pins its host tier at start (the 27B at 8 requests: 9.4 GB of host KV pages and
state slots). torch's default pins each buffer with one cudaHostAlloc, whose page faults run
on one thread: 3.3 s of a restart on an H100 host. With pinned_use_cuda_host_register it maps
the buffer, touches its pages on pinned_num_register_threads threads, then registers it with
CUDA; the memory is page-locked as before.
"""

from __future__ import annotations

import os

import torch
from ninfer.host_cpus import usable_cpus

MAX_REGISTER_THREADS = 8
_USER_SETTINGS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def pinned_allocator_settings(available_cpus: int) -> str | None:
    """The allocator setting to apply, or None where the user's environment chose the pinned path."""
    if any("pinned_" in os.environ.get(name, "") for name in _USER_SETTINGS):
        return None
    threads = max(1, min(MAX_REGISTER_THREADS, available_cpus // 2))
    return f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"


def configure_pinned_allocator() -> None:
    """Call before the first pinned allocation of a CUDA engine process."""
    available = usable_cpus()
    settings = pinned_allocator_settings(available)
    if settings is None:
        return
    # torch 2.11 moved the setter to the accelerator-generic name and deprecated the CUDA one.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(settings)
