"""StartCompiles: the kernel manifest's part in one GPU engine start (kernels/compile_manifest.py).

Where this machine's cache holds no manifest for the model yet and a packaged one fits, the
manifest compiles on worker processes while the weights load; the start records what it
compiles, and that record, merged into what earlier starts recorded, is this machine's manifest.
With PRELOAD_KERNELS the start also brings the manifest's kernels into the process while it
would otherwise wait (its first steps otherwise look each one up in the kernel cache and load its
module as it first launches): a restart on a thread beside the weight load, a fresh start as each
compile ahead finishes, while the engine waits for the rest.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path

from ninfer.kernels import compile_manifest
from ninfer.kernels.compile_manifest import (
    KernelManifest,
    Precompile,
    autotune_records,
    manifest_key,
    precompile_workers,
    preload_in_process,
    recording_compiles,
    start_precompile,
)
from ninfer.models.config import ModelConfig

log = logging.getLogger("ninfer.engine")

# Off until timed on a GPU. A restart's thread shares the interpreter with the weight load, which
# only places tensors then (--quantize launches kernels: no thread beside it).
PRELOAD_KERNELS = False

# ModelConfig fields that change values the kernels read, never a kernel's specialization: a
# checkpoint's own ids, limits and rotary base share the manifest of its architecture's shapes.
_VALUE_FIELDS = frozenset({
    "num_hidden_layers", "layer_types", "mtp_num_hidden_layers", "rms_norm_eps", "max_position_embeddings",
    "rope_theta", "rope_scaling", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings",
    "extra",
})


def model_identity(config: ModelConfig, dtype: str, quantize: str | None, stored_format: str) -> str:
    """What picks a model's kernel specializations before the engine's own settings: its shapes
    and layer kinds, the dtype its weights run in (--dtype resolved), --quantize and the stored
    weight format."""
    shapes = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in _VALUE_FIELDS}
    shapes["layer_kinds"] = sorted(set(config.layer_types))
    return f"{shapes!r} dtype {dtype}, --quantize {quantize}, stored {stored_format}"


class StartCompiles:
    """The manifest's part in one GPU engine start: where this machine's cache has no manifest
    for this model yet and a packaged one fits, compile it on worker processes while the weights
    load; record what this start compiles, kept as this machine's manifest."""

    def __init__(self, identity: str, cache_root: Path, packaged: Path | None = None):
        """identity: model_identity(); packaged: where packaged manifests are (default
        compile_manifest.PACKAGED)."""
        self.identity = identity
        self.local_dir = cache_root / "kernel-manifests"
        self.packaged_dir = packaged if packaged is not None else compile_manifest.PACKAGED
        self.key: str | None = None
        self.precompile: Precompile | None = None
        self._recording: AbstractContextManager[list[str]] | None = None
        self._target: dict = {}
        self._recorded: list[str] = []
        self._num_saved = 0  # records already merged into the machine's manifest
        self._began = 0.0  # wall-clock time recording began: autotuning results from then on are this start's
        self._preload: threading.Thread | None = None  # a restart's, beside the weight load
        self._num_preloaded = 0
        self._preload_errors: list[str] = []

    def begin(self, launches_during_load: bool = False) -> None:
        """After CUDA started (the target is the current device's), before any kernel launches.
        An optimisation only: whatever fails here leaves the kernels to compile at first launch.
        launches_during_load: the load runs Triton kernels (--quantize), so nothing preloads beside it."""
        try:
            self._begin(launches_during_load)
        except Exception as error:  # noqa: BLE001
            log.warning("kernel manifest not used: %s: %s", type(error).__name__, error)

    def _begin(self, launches_during_load: bool) -> None:
        import torch
        import triton
        from triton.runtime.driver import driver

        target = dataclasses.asdict(driver.active.get_current_target())
        self._target = target
        self.key = manifest_key(self.identity, triton.__version__, target)
        local = self.local_dir / f"{self.key}.json"
        packaged = KernelManifest.load(self.packaged_dir / f"{self.key}.json.gz") or KernelManifest.load(
            self.packaged_dir / f"{self.key}.json"
        )
        self._began = time.time()  # before the packaged results are written: this cache holds them too
        if not local.exists() and packaged is not None and packaged.usable_with(triton.__version__, target):
            workers = precompile_workers()
            self.precompile = start_precompile(packaged, workers)
            log.info("compiling %d GPU kernels ahead on %d processes (a manifest for this model, with %d"
                     " autotuning results)", len(packaged.specializations), self.precompile.num_workers,
                     self.precompile.num_autotuned)  # fmt: skip
        elif local.exists() and PRELOAD_KERNELS and not launches_during_load:
            kept = KernelManifest.load(local)
            if kept is not None and kept.usable_with(triton.__version__, target):
                self._preload = threading.Thread(target=self._preload_all, args=(kept, torch.cuda.current_device()),
                                                 name="ninfer-kernel-preload", daemon=True)
                self._preload.start()
        self._recording = recording_compiles()
        self._recorded = self._recording.__enter__()

    def _preload_all(self, manifest: KernelManifest, device: int) -> None:
        import torch

        torch.cuda.set_device(device)
        for data in manifest.specializations:
            self._preload_one(data)

    def _preload_one(self, data: str) -> None:
        error = preload_in_process(data)
        if error is None:
            self._num_preloaded += 1
        else:
            self._preload_errors.append(error)

    def _log_preloaded(self, how: str) -> None:
        log.info("%d GPU kernels brought into the process %s%s", self._num_preloaded, how,
                 f" ({len(self._preload_errors)} left to their launch)" if self._preload_errors else "")
        for error in self._preload_errors:
            log.debug("not preloaded: %s", error)

    def loaded(self) -> None:
        """The weights are in place: the first kernels launch next, so the compiles (or the
        preload) finish first."""
        if self._preload is not None:
            waited = time.perf_counter()
            self._preload.join()
            self._preload = None
            self._log_preloaded(f"from the kernel cache beside the load (waited {time.perf_counter() - waited:.1f} s after it)")
        if self.precompile is None:
            return
        done, errors, seconds = self.precompile.wait(self._preload_one if PRELOAD_KERNELS else None)
        log.info("%d GPU kernels compiled ahead in %.1f s%s", done, seconds,
                 f" ({len(errors)} left to compile at first launch)" if errors else "")  # fmt: skip
        for error in errors:
            log.debug("not compiled ahead: %s", error)
        if PRELOAD_KERNELS:
            self._log_preloaded("as their compiles finished")
        self.precompile = None

    def save(self) -> None:
        """Merge what this start recorded so far into this machine's manifest (the record only
        grows: a restart's short warm-up launches fewer kernels than a first start); nothing to
        do where nothing was recorded since the last save."""
        if len(self._recorded) == self._num_saved:
            return
        self._num_saved = len(self._recorded)
        import triton

        path = self.local_dir / f"{self.key}.json"
        kept = KernelManifest.load(path)
        if kept is not None and not kept.usable_with(triton.__version__, self._target):
            kept = None
        known = kept.specializations if kept is not None else []
        seen = set(known)
        new = [data for data in self._recorded if data not in seen]
        # What the autotuners benchmarked during this start (a restart finds them cached: none).
        known_tuned = kept.autotune if kept is not None else []
        tuned_seen = {(record["key"], record["file"]) for record in known_tuned}
        tuned = [record for record in autotune_records(Path(triton.knobs.cache.dir), self._began)
                 if (record["key"], record["file"]) not in tuned_seen]  # fmt: skip
        if new or tuned or kept is None:
            try:
                KernelManifest(triton.__version__, self._target, known + new, known_tuned + tuned).save(path)
            except OSError as error:
                log.warning("kernel manifest not saved to %s: %s", path, error)

    def end(self, keep: bool) -> None:
        """Stop recording; keep: the start ran to the end (or its idle captures did), so its
        record joins this machine's manifest."""
        if self.precompile is not None:  # a start that failed before its weights were in place
            self.precompile.pool.shutdown(wait=False, cancel_futures=True)
            self.precompile = None
        if self._preload is not None:
            self._preload.join()
            self._preload = None
        if self._recording is None:
            return
        self._recording.__exit__(None, None, None)
        self._recording = None
        if keep:
            self.save()
