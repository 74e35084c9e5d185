"""KernelManifest: the Triton kernel specializations a start compiled, to compile ahead next time.

A fresh machine's first start of the 27B spends most of its ~2 minutes compiling Triton kernels,
one after another, as each first runs. A compile needs the kernel's source, its specialization
and the GPU's target, not the GPU itself. So the engine records every specialization its full
warm-up compiled (Triton's own serialization, through its post-compile hook), and a later start
with an empty kernel cache compiles the recorded list on worker processes while the weights
load; each launch then finds its kernel in the cache, as on a restart. The workers compile for
the recorded target through a stand-in driver that answers Triton's device queries without CUDA,
so they take no GPU memory. An entry this start does not launch only costs its compile.

Autotuned kernels (the Gated DeltaNet chunk kernels' configs, for one) also benchmark every
config at their first launch of each tuning key; Triton keeps the timings in its cache under a
key of the kernel's source, the target, the Triton build and the tuning key, none of them the
machine's. The manifest carries those files too, and a start that compiles it ahead writes them
into its cache, so the autotuners find their choice instead of benchmarking (the recording GPU's
choice: another card of the same target may have preferred another config).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import json
import logging
import multiprocessing
import os
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from ninfer.host_cpus import usable_cpus

log = logging.getLogger("ninfer.engine")

FORMAT_VERSION = 1


@dataclass
class KernelManifest:
    triton_version: str
    target: dict  # Triton's GPUTarget as a dict: backend, arch, warp_size
    specializations: list[str] = field(default_factory=list)  # Triton's serialized specialization data
    # Autotuning results as Triton caches them: {"key": cache key, "file": name, "text": contents}.
    autotune: list[dict] = field(default_factory=list)

    def save(self, path: Path) -> None:
        """JSON, gzip-compressed where the name ends in .gz (packaged manifests: ~10x smaller)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        body = {"format": FORMAT_VERSION, "triton": self.triton_version, "target": self.target,
                "specializations": self.specializations, "autotune": self.autotune}  # fmt: skip
        text = (json.dumps(body) + "\n").encode()
        # mtime 0: the same manifest compresses to the same bytes.
        temporary.write_bytes(gzip.compress(text, mtime=0) if path.name.endswith(".gz") else text)
        temporary.replace(path)  # a concurrent reader sees the old file or the new one

    @staticmethod
    def load(path: Path) -> KernelManifest | None:
        """None when absent, unreadable, or written by another format."""
        try:
            raw = path.read_bytes()
            body = json.loads(gzip.decompress(raw) if path.name.endswith(".gz") else raw)
        except (OSError, ValueError, EOFError, zlib.error):
            return None
        if not isinstance(body, dict) or body.get("format") != FORMAT_VERSION:
            return None
        return KernelManifest(body["triton"], body["target"], list(body["specializations"]),
                              list(body.get("autotune", [])))  # fmt: skip

    def usable_with(self, triton_version: str, target: dict) -> bool:
        """A specialization compiles to the same kernel only under the same Triton and target."""
        return self.triton_version == triton_version and self.target == target


@contextmanager
def _after_each_compile(callback) -> Iterator[None]:
    """Within: callback(kwargs of Triton's post-compile hook) after every Triton kernel this process
    compiles or loads from the kernel cache; a hook set before keeps being called."""
    from triton import knobs

    previous = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):
        callback(kwargs)  # called inside every compile: it must not raise
        return previous(**kwargs) if previous is not None else False

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield
    finally:
        knobs.runtime.jit_post_compile_hook = previous


@contextmanager
def recording_compiles() -> Iterator[list[str]]:
    """Within: every Triton kernel compiled (or loaded from the kernel cache) in this process is
    appended to the yielded list once, as Triton serializes its specialization."""
    recorded: list[str] = []
    seen: set[str] = set()

    def record(kwargs: dict) -> None:
        data = (kwargs.get("compile") or {}).get("specialization_data")
        if isinstance(data, str) and data not in seen:
            seen.add(data)
            recorded.append(data)

    with _after_each_compile(record):
        yield recorded


@contextmanager
def counting_compiles() -> Iterator[list[int]]:
    """Within: the yielded one-element list counts the Triton kernels this process compiled or
    loaded from the kernel cache (each specialization new to the process, once)."""
    count = [0]

    def increment(kwargs: dict) -> None:
        count[0] += 1

    with _after_each_compile(increment):
        yield count


class _TargetOnlyDriver:
    """Answers what JITFunction.preload asks of the driver for `target` (no launch, no CUDA)."""

    def __init__(self, target, drivers):
        self._target = target
        self._drivers = drivers  # Triton's DriverConfig: its default driver only where asked for

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self._target

    def is_active(self) -> bool:
        return True

    def __getattr__(self, name):
        return getattr(self._drivers.default, name)


def _jit_function(name: str):
    """The JITFunction a specialization names (module path, then attribute; autotuner and
    heuristics wrappers unwrapped)."""
    from triton.runtime.jit import JITFunction

    module_name, _, attribute = name.rpartition(".")
    kernel = getattr(importlib.import_module(module_name), attribute)
    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


@contextmanager
def compiling_for(target: dict) -> Iterator[None]:
    """Within: Triton compiles for `target` whatever GPU this machine has, or none (launches
    would fail: only compiles, preloads and kernel warm-ups)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    # Not reset_active(): that creates the default driver, which a host without a GPU lacks.
    previous = driver._active
    driver.set_active(_TargetOnlyDriver(GPUTarget(**target), driver))
    try:
        yield
    finally:
        driver._active = previous


def _portable(body: dict) -> str:
    """A specialization without the recording machine's libdevice path (Triton's CUDA options
    name the file it links): this machine's Triton fills in its own, and the kernel cache is keyed
    by the file's contents, not its path, so the key stays the one a launch here looks up."""
    options = body.get("options") or {}
    libraries = [entry for entry in options.get("extern_libs") or () if entry[0] != "libdevice"]
    if libraries:
        options["extern_libs"] = libraries
    else:
        options.pop("extern_libs", None)
    return json.dumps(body)


def _compile_one(target: dict, data: str) -> str | None:
    """A worker's task: compile one specialization into the kernel cache (or find it there);
    -> None, or what stopped it."""
    body = json.loads(data)
    name = body["name"]
    try:
        with compiling_for(target):
            _jit_function(name).preload(_portable(body))
    except Exception as error:  # noqa: BLE001 - one entry that no longer compiles skips only itself
        return f"{name}: {type(error).__name__}: {error}"[:300]
    return None


def preload_in_process(data: str) -> str | None:
    """Bring one specialization from the kernel cache into this process's JIT cache, its GPU
    module loaded, on the calling thread's current device: its launch then skips the cache lookup
    and the module load. -> None, or what stopped it (the kernel then loads at its launch)."""
    body = json.loads(data)
    try:
        kernel = _jit_function(body["name"]).preload(_portable(body))
        init_handles = getattr(kernel, "_init_handles", None)
        if init_handles is not None:
            init_handles()
    except Exception as error:  # noqa: BLE001
        return f"{body['name']}: {type(error).__name__}: {error}"[:300]
    return None


def autotune_records(cache_dir: Path, since: float) -> list[dict]:
    """The autotuning results Triton cached under cache_dir (its file cache: <key>/<kernel>.autotune.json)
    since the wall-clock time `since`."""
    records = []
    for path in sorted(cache_dir.glob("*/*.autotune.json")):
        try:
            if path.stat().st_mtime >= since:
                records.append({"key": path.parent.name, "file": path.name, "text": path.read_text()})
        except (OSError, UnicodeDecodeError):
            continue  # another process replacing it: the next save sees it
    return records


def restore_autotune(records: list[dict]) -> int:
    """Write autotuning results into Triton's file cache where it has none under their key; -> how
    many (none where Triton caches through a manager of the user's own)."""
    from triton import knobs

    if knobs.cache.manager_class is not None:
        return 0
    written = 0
    for record in records:
        directory, name = record["key"], record["file"]
        if Path(directory).name != directory or Path(name).name != name or directory in ("", ".", ".."):
            continue  # a plain name inside the cache, nothing else
        path = Path(knobs.cache.dir) / directory / name
        if path.exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{name}.{os.getpid()}.tmp")
        temporary.write_text(record["text"])
        temporary.replace(path)  # as Triton writes its cache: a reader sees the whole file or none
        written += 1
    return written


@dataclass
class Precompile:
    """Compiles running on worker processes; the engine goes on meanwhile."""

    started: float
    futures: list[Future]  # one per specialization, in the recorded (first launch) order
    pool: ProcessPoolExecutor
    num_workers: int
    num_autotuned: int  # autotuning results written into the cache before the compiles
    specializations: list[str] = field(default_factory=list)  # the futures' own

    def wait(self, on_compiled: Callable[[str], None] | None = None) -> tuple[int, list[str], float]:
        """-> (compiled or cached, errors, seconds since the start). on_compiled(specialization):
        called in order for each one compiled, while the later ones still compile."""
        done, errors = 0, []
        for index, future in enumerate(self.futures):
            try:
                error = future.result()
            except Exception as failure:  # noqa: BLE001 - a worker that died: its kernels compile at first launch
                error = f"worker: {type(failure).__name__}: {failure}"
            if error is None:
                done += 1
                if on_compiled is not None:
                    on_compiled(self.specializations[index])
            else:
                errors.append(error)
        self.pool.shutdown()
        return done, errors, time.perf_counter() - self.started


def start_precompile(manifest: KernelManifest, num_workers: int) -> Precompile:
    """Write the manifest's autotuning results into the kernel cache, then compile its
    specializations there on `num_workers` processes (spawned: they inherit TRITON_CACHE_DIR and
    the rest of the environment), each taking the next kernel as it finishes one."""
    started = time.perf_counter()
    num_autotuned = restore_autotune(manifest.autotune)
    pool = ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"))
    futures = [pool.submit(_compile_one, manifest.target, data) for data in manifest.specializations]
    return Precompile(started, futures, pool, num_workers, num_autotuned, list(manifest.specializations))


def precompile_workers() -> int:
    """The CPUs this process may use but two (at least one): compiling is all that is left once
    the weights are in place, and the load's reader threads keep the two meanwhile."""
    available = usable_cpus()
    return max(1, available - 2)


PACKAGED = Path(__file__).parent / "manifests"  # manifests recorded on GPUs for the models users run


def manifest_key(model_identity: str, triton_version: str, target: dict) -> str:
    """A manifest's file name: the model, the Triton that compiles and the GPU it compiles for."""
    text = json.dumps([model_identity, triton_version, target], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]
