"""Imports the engine needs only at its first prompt steps, run on a thread while the model loads.

torch's SDPA masks (`torch.nn.attention.bias`, the lower-right causal mask of a chunk over
cached context) and fla-core's chunked rule (whose `torch.compiler.disable` decorators) both
import torch's compiler stack: 3.5 s of the engine's 7.5 s of imports on an H100 host, all of
it Python. Imported at module level they would run before anything else of the start; here
they run beside the checks, the weights' load (threads waiting on reads and copies) and the
decode graphs' capture, which need none of them. A module the main thread reaches first is
simply waited for (Python's import lock), and a missing one (fla-core on a CPU install) is left
to the code that uses it to report.

The thread holds the GIL while it imports, and the checks and the load's hand-offs between
threads wait for it, so it imports only what the engine uses: fla-core's package inits import
every op family it has (fla.ops: 274 fla modules for the five below, which need 43; 4.8-5.6 s
against 1.5-2.1 s on a 2-CPU host, torch already imported). Those inits are deferred
(defer_package_init): the submodules import without them, and a name a package itself defines
(`from fla.ops import chunk_gated_delta_rule`, as transformers imports it) runs its init then.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
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
THREAD_NAME = "engine-imports"
# Packages between fla and the modules above whose __init__ imports what the engine never runs.
DEFERRED_INITS = ("fla.ops", "fla.ops.gated_delta_rule", "fla.modules", "fla.modules.norm")


def start_background_imports(
    modules: tuple[str, ...] = MODULES, deferred: tuple[str, ...] = DEFERRED_INITS
) -> threading.Thread:
    """Import `modules` on a daemon thread, the `deferred` packages' inits put off first; -> the
    thread (joined by nobody: importers wait on it)."""
    thread = threading.Thread(target=_import_all, args=(modules, deferred), name=THREAD_NAME, daemon=True)
    thread.start()
    return thread


def wait_for_background_imports(timeout: float = 60.0) -> None:
    """Before the process exits: an import still running on the thread (a server stopped just
    after ready) would fail inside the interpreter's teardown and print its traceback."""
    for thread in threading.enumerate():
        if thread.name == THREAD_NAME:
            thread.join(timeout)


def defer_package_init(name: str) -> bool:
    """Register package `name` with its search path but without running its __init__, which runs
    at the first access of a name the package does not hold yet (a submodule imported meanwhile
    is held). -> False where it is already imported or not installed (nothing changes)."""
    if name in sys.modules:
        return False
    try:
        spec = importlib.util.find_spec(name)  # imports the parent packages
    except ImportError:
        return False
    if spec is None or spec.submodule_search_locations is None or name in sys.modules:
        return False
    package = importlib.util.module_from_spec(spec)
    lock = threading.Lock()

    def complete(attribute: str):
        with lock:
            if package.__dict__.get("__getattr__") is complete:
                del package.__dict__["__getattr__"]
                spec.loader.exec_module(package)
        try:
            return package.__dict__[attribute]
        except KeyError:
            raise AttributeError(f"module {name!r} has no attribute {attribute!r}") from None

    package.__getattr__ = complete  # PEP 562: asked only for names the module does not hold
    sys.modules[name] = package
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, package)
    return True


def _import_all(modules: tuple[str, ...], deferred: tuple[str, ...] = ()) -> None:
    started = time.perf_counter()
    for name in deferred:
        defer_package_init(name)
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as error:
            log.debug("background import of %s skipped: %s", name, error)
    log.debug("background imports done in %.1fs", time.perf_counter() - started)
