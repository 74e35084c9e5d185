"""Suite-wide test setup."""

import gc
import importlib.abc
import logging
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():

    class _NoFlashLinearAttention(importlib.abc.MetaPathFinder):
        """transformers swaps its torch gated-delta-rule reference for fla's Triton kernels whenever
        fla imports, and those cannot run on CPU; without a GPU the parity reference must stay torch."""

        def find_spec(self, name, path, target=None):
            if name == "fla" or name.startswith("fla."):
                raise ImportError("flash-linear-attention is GPU-only; hidden from the CPU test suite")
            return None

    sys.meta_path.insert(0, _NoFlashLinearAttention())

if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("OMP_NUM_THREADS"):
    # Workers share the CPUs: one torch thread each, or their OpenMP barriers wait on each other
    # (a CPU engine takes one thread per two CPUs for the same reason, engine/builder.py).
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(autouse=True)
def _restore_ninfer_logger():
    """Building an engine in-process calls `setup_logging`, which stops the `ninfer` logger from
    propagating; restore it so a later test's `caplog` still sees the records."""
    logger = logging.getLogger("ninfer")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.fixture(autouse=True)
def _release_finished_apps():
    """FastAPI keeps each route's endpoint in module-level LRU caches (4096 entries), and the
    endpoints close over their server's Serving: without this, every server a test started kept
    its engine, model and tokenizer in memory until the suite ended (tens of GB over the suite)."""
    yield
    models = sys.modules.get("fastapi.dependencies.models")
    for cache in ("_is_gen_callable_cached", "_is_async_gen_callable_cached", "_is_coroutine_callable_cached"):
        cached = getattr(models, cache, None)
        if cached is not None:
            cached.cache_clear()


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory(request):
    """A GPU test's freed tensors go back to the card, not to this process's caching allocator:
    several test processes share one GPU (`-n`), and one process's cache of an earlier test's
    peak would leave the others out of memory."""
    yield
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()
