"""Imports the engine needs only at its first prompt steps, run on a thread while the model loads.

torch's SDPA masks (`torch.nn.attention.bias`, the lower-right causal mask of a chunk over
cached context) and fla-core's chunked rule (whose `torch.compiler.disable` decorators) both
import torch's compiler stack: 3.5 s of the engine's 7.5 s of imports on an H100 host, all of
it Python. Imported at module level they would run before anything else of the start; here
they run beside the checks, the weights' load (threads waiting on reads and copies) and the
decode graphs' capture, which need none of them. A module the main thread reaches first is
simply waited for (Python's import lock), and a missing one (fla-core on a CPU install) is left
to the code that uses it to report.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time

log = logging.getLogger("ninfer.engine")

MODULES = (
    "torch.nn.attention.bias",
    "fla.modules.norm.l2norm",
    "fla.ops.common.chunk_delta_h",
    "fla.ops.common.chunk_o",
    "fla.ops.gated_delta_rule.chunk_fwd",
    "fla.ops.utils",
)


def start_background_imports(modules: tuple[str, ...] = MODULES) -> threading.Thread:
    """Import `modules` on a daemon thread; -> the thread (joined by nobody: importers wait on it)."""
    thread = threading.Thread(target=_import_all, args=(modules,), name="engine-imports", daemon=True)
    thread.start()
    return thread


def _import_all(modules: tuple[str, ...]) -> None:
    started = time.perf_counter()
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as error:
            log.debug("background import of %s skipped: %s", name, error)
    log.debug("background imports done in %.1fs", time.perf_counter() - started)
