"""KernelManifest on a host without a GPU: a kernel's specializations compiled for an H100's
target are recorded, saved, and compiled again from the manifest on worker processes into an
empty kernel cache, where a second compile finds them (Triton compiles without the GPU; its
ptxas ships with it). Each step runs in a fresh interpreter, as an engine start would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer.kernels.compile_manifest import KernelManifest

pytest.importorskip("triton")

H100 = {"backend": "cuda", "arch": 90, "warp_size": 32}

# Two sizes of the fused residual-add RMSNorm, warmed up (compiled, not launched) for the target.
_RECORD = """
import json, sys, torch, triton
from ninfer.kernels.compile_manifest import KernelManifest, compiling_for, recording_compiles
from ninfer.kernels.rms_norm.triton import _add_rms_norm_kernel as kernel
target = json.loads(sys.argv[1])
x = torch.empty(8, 5120, dtype=torch.bfloat16)
with compiling_for(target), recording_compiles() as recorded:
    for dim, block in ((5120, 8192), (2048, 2048), (2048, 2048)):
        kernel.warmup(x, x, x[0], x, x, 1, dim, 0, dim, 0, dim, 1e-6, ZERO_CENTERED=True, TWO_LEVEL=False,
                      BLOCK_D=block, EARLY_RESIDUAL=False, USE_PDL=False, num_warps=8, grid=(1,))
KernelManifest(triton.__version__, target, recorded).save(__import__("pathlib").Path(sys.argv[2]))
"""

_PRECOMPILE = """
import sys
from pathlib import Path
from ninfer.kernels.compile_manifest import KernelManifest, start_precompile
manifest = KernelManifest.load(Path(sys.argv[1]))
finished = []  # what the engine's thread is handed as each compile finishes (PRELOAD_KERNELS)
done, errors, seconds = start_precompile(manifest, 2).wait(finished.append)
# Handed over in the recorded order, each compiled one once.
assert len(finished) == done and finished == [data for data in manifest.specializations if data in finished]
print(done, len(errors))
for error in errors:
    print(error, file=sys.stderr)
"""


def _run(script: str, *args: str, cache: Path) -> str:
    env = {**__import__("os").environ, "TRITON_CACHE_DIR": str(cache)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def _compiled_kernels(cache: Path) -> set[str]:
    return {path.parent.name for path in cache.rglob("*.cubin")}


def test_a_recorded_manifest_compiles_on_workers_into_an_empty_cache(tmp_path):
    manifest_path = tmp_path / "manifest.json"
    _run(_RECORD, json.dumps(H100), str(manifest_path), cache=tmp_path / "recording-cache")
    manifest = KernelManifest.load(manifest_path)
    assert manifest is not None and manifest.target == H100
    # The repeated size compiles once and is recorded once.
    assert len(manifest.specializations) == 2
    assert {json.loads(s)["name"] for s in manifest.specializations} == {
        "ninfer.kernels.rms_norm.triton._add_rms_norm_kernel"
    }
    recorded_kernels = _compiled_kernels(tmp_path / "recording-cache")
    assert len(recorded_kernels) == 2

    cache = tmp_path / "fresh-cache"
    assert _run(_PRECOMPILE, str(manifest_path), cache=cache).split() == ["2", "0"]
    # The same two kernels, under the same cache keys a launch-time compile looks up.
    assert _compiled_kernels(cache) == recorded_kernels
    assert _run(_PRECOMPILE, str(manifest_path), cache=cache).split() == ["2", "0"]
    assert _compiled_kernels(cache) == recorded_kernels


def test_a_manifest_recorded_where_triton_lives_elsewhere_compiles_under_this_machines_keys(tmp_path):
    """A packaged manifest comes from another machine: its entries name that machine's libdevice
    file. They compile here under the keys this machine's launches look up."""
    manifest_path = tmp_path / "manifest.json"
    _run(_RECORD, json.dumps(H100), str(manifest_path), cache=tmp_path / "recording-cache")
    manifest = KernelManifest.load(manifest_path)
    moved = []
    for data in manifest.specializations:
        body = json.loads(data)
        libraries = dict(body["options"]["extern_libs"])
        assert Path(libraries["libdevice"]).is_file()  # recorded with this machine's path
        body["options"]["extern_libs"] = [["libdevice", "/elsewhere/site-packages/triton/libdevice.10.bc"]]
        moved.append(json.dumps(body))
    manifest.specializations = moved
    manifest.save(manifest_path)
    cache = tmp_path / "fresh-cache"
    assert _run(_PRECOMPILE, str(manifest_path), cache=cache).split() == ["2", "0"]
    assert _compiled_kernels(cache) == _compiled_kernels(tmp_path / "recording-cache")


def test_an_entry_that_no_longer_resolves_skips_only_itself(tmp_path):
    manifest_path = tmp_path / "manifest.json"
    _run(_RECORD, json.dumps(H100), str(manifest_path), cache=tmp_path / "recording-cache")
    manifest = KernelManifest.load(manifest_path)
    gone = json.loads(manifest.specializations[0])
    gone["name"] = "ninfer.kernels.rms_norm.triton._a_kernel_since_removed"
    manifest.specializations.append(json.dumps(gone))
    manifest.save(manifest_path)
    assert _run(_PRECOMPILE, str(manifest_path), cache=tmp_path / "fresh-cache").split() == ["2", "1"]


def test_a_manifest_is_used_only_with_its_triton_and_target(tmp_path):
    path = tmp_path / "m.json"
    KernelManifest("3.6.0", H100, ["{}"]).save(path)
    manifest = KernelManifest.load(path)
    assert manifest.usable_with("3.6.0", H100)
    assert not manifest.usable_with("3.8.0", H100)
    assert not manifest.usable_with("3.6.0", {**H100, "arch": 100})
    path.write_text('{"format": 0}')
    assert KernelManifest.load(path) is None
    packed = tmp_path / "m.json.gz"
    KernelManifest("3.6.0", H100, ["{}"] * 100).save(packed)
    assert KernelManifest.load(packed) == KernelManifest("3.6.0", H100, ["{}"] * 100)
    assert packed.read_bytes()[:2] == b"\x1f\x8b"  # gzip
    packed.write_bytes(b"\x1f\x8b not gzip after all")
    assert KernelManifest.load(packed) is None
    assert KernelManifest.load(tmp_path / "absent.json") is None


_START = """
import json, sys, torch, triton
from pathlib import Path
from ninfer.engine.start_compiles import StartCompiles
from ninfer.kernels.compile_manifest import KernelManifest, compiling_for, manifest_key
from ninfer.kernels.rms_norm.triton import _add_rms_norm_kernel as kernel
target, packaged_manifest, root = json.loads(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
packaged = root / "packaged"
key = manifest_key("a model", triton.__version__, target)
manifest = KernelManifest.load(packaged_manifest)
tuned = {"key": "0" * 64, "file": "_a_kernel.autotune.json", "text": '{"key": [5120], "configs_timings": []}'}
manifest.autotune = [tuned]
manifest.save(packaged / f"{key}.json.gz")
x = torch.empty(8, 5120, dtype=torch.bfloat16)
facts = []
for start in range(2):
    with compiling_for(target):  # stands in for the engine's GPU
        compiles = StartCompiles("a model", root / "cache", packaged)
        compiles.begin()
        facts.append(compiles.precompile is not None and compiles.precompile.num_autotuned)
        compiles.loaded()
        # The start's own launches (one of the packaged sizes, then one of its own).
        for dim, block in ((5120, 8192), (1024, 1024)):
            kernel.warmup(x, x, x[0], x, x, 1, dim, 0, dim, 0, dim, 1e-6, ZERO_CENTERED=True, TWO_LEVEL=False,
                          BLOCK_D=block, EARLY_RESIDUAL=False, USE_PDL=False, num_warps=8, grid=(1,))
        compiles.end(keep=True)
    local = KernelManifest.load(root / "cache" / "kernel-manifests" / f"{key}.json")
    facts.append(len(local.specializations))
    facts.append(local.autotune == [tuned])
facts.append((Path(triton.knobs.cache.dir) / tuned["key"] / tuned["file"]).read_text() == tuned["text"])
print(json.dumps(facts))
"""


def test_a_start_compiles_a_packaged_manifest_ahead_once_and_keeps_its_own_record(tmp_path):
    """First start: the packaged manifest (2 sizes) compiles ahead into the empty kernel cache and
    the start's record (one of them plus a size of its own) becomes this machine's manifest;
    second start: that manifest exists, so nothing compiles ahead, and the record stays. The
    packaged autotuning result is written into the kernel cache before the compiles and stays in
    the machine's record."""
    manifest_path = tmp_path / "manifest.json"
    _run(_RECORD, json.dumps(H100), str(manifest_path), cache=tmp_path / "recording-cache")
    cache = tmp_path / "kernels"
    facts = json.loads(_run(_START, json.dumps(H100), str(manifest_path), str(tmp_path), cache=cache))
    assert facts == [1, 2, True, False, 2, True, True]
    # Ahead: the two packaged sizes; at launch: the start's own size.
    assert len(_compiled_kernels(cache)) == 3


_SAVE_THEN_END = """
import json, sys, torch, triton
from pathlib import Path
from ninfer.engine.start_compiles import StartCompiles
from ninfer.kernels.compile_manifest import KernelManifest, compiling_for, counting_compiles, manifest_key
from ninfer.kernels.rms_norm.triton import _add_rms_norm_kernel as kernel
target, root = json.loads(sys.argv[1]), Path(sys.argv[2])
path = root / "kernel-manifests" / (manifest_key("a model", triton.__version__, target) + ".json")
x = torch.empty(8, 5120, dtype=torch.bfloat16)

def launch(dim, block):
    kernel.warmup(x, x, x[0], x, x, 1, dim, 0, dim, 0, dim, 1e-6, ZERO_CENTERED=True, TWO_LEVEL=False,
                  BLOCK_D=block, EARLY_RESIDUAL=False, USE_PDL=False, num_warps=8, grid=(1,))

facts = []
with compiling_for(target):
    compiles = StartCompiles("a model", root)
    compiles.begin()
    compiles.loaded()
    launch(5120, 8192)  # the start
    compiles.save()  # ready: the record so far is kept
    facts.append(len(KernelManifest.load(path).specializations))
    with counting_compiles() as compiled:  # an idle capture: one new size, one known
        launch(1024, 1024)
        launch(5120, 8192)
    facts.append(compiled[0])
    compiles.save()  # kept after each idle capture: a process that ends here keeps it
    facts.append(len(KernelManifest.load(path).specializations))
    compiles.end(keep=True)  # the idle captures are done
    facts.append(len(KernelManifest.load(path).specializations))
    launch(2048, 2048)  # after the record ended
facts.append(len(KernelManifest.load(path).specializations))
print(json.dumps(facts))
"""


def test_a_start_keeps_its_record_at_ready_and_adds_the_idle_captures_kernels(tmp_path):
    """save() at ready keeps the start's record; what an idle capture compiles joins it at the
    save after it, and end() keeps it; counting_compiles counts only kernels new to the process."""
    facts = json.loads(_run(_SAVE_THEN_END, json.dumps(H100), str(tmp_path / "root"), cache=tmp_path / "kernels"))
    assert facts == [1, 1, 2, 2, 2]


def test_autotuning_results_recorded_since_a_time_and_restored_where_absent(tmp_path, monkeypatch):
    from ninfer.kernels.compile_manifest import autotune_records, restore_autotune

    recorded_cache = tmp_path / "recorded"
    old, new = recorded_cache / "aa" / "old.autotune.json", recorded_cache / "bb" / "new.autotune.json"
    for path, text in ((old, "old timings"), (new, "new timings")):
        path.parent.mkdir(parents=True)
        path.write_text(text)
    (recorded_cache / "bb" / "kernel.cubin").write_bytes(b"not a tuning result")
    __import__("os").utime(old, (1000.0, 1000.0))
    records = autotune_records(recorded_cache, since=2000.0)
    assert records == [{"key": "bb", "file": "new.autotune.json", "text": "new timings"}]

    target_cache = tmp_path / "empty"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(target_cache))
    (target_cache / "cc").mkdir(parents=True)
    (target_cache / "cc" / "mine.autotune.json").write_text("this machine's timings")
    mine = {"key": "cc", "file": "mine.autotune.json", "text": "the recording machine's timings"}
    assert restore_autotune(records + [mine]) == 1  # this machine's own result stays
    assert (target_cache / "bb" / "new.autotune.json").read_text() == "new timings"
    assert (target_cache / "cc" / "mine.autotune.json").read_text() == "this machine's timings"


def _cli(*args: str, cache_root: Path) -> subprocess.CompletedProcess:
    env = {**__import__("os").environ, "NINFER_CACHE_DIR": str(cache_root)}
    env.pop("TRITON_CACHE_DIR", None)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "ninfer.cli", "compile-kernels", *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=Path(__file__).resolve().parents[2])  # fmt: skip


def test_compile_kernels_fills_an_images_cache_without_a_gpu(tmp_path):
    recorded = tmp_path / "0123abcd.json"
    _run(_RECORD, json.dumps(H100), str(recorded), cache=tmp_path / "recording-cache")
    packed = tmp_path / "packed" / "0123abcd.json.gz"  # as packaged manifests are stored
    KernelManifest.load(recorded).save(packed)
    root = tmp_path / "image-cache"
    done = _cli(str(packed), "--workers", "2", cache_root=root)
    assert done.returncode == 0, done.stderr
    assert "2 of 2 kernels compiled for cuda sm_90" in done.stdout
    assert _compiled_kernels(root / "triton") == _compiled_kernels(tmp_path / "recording-cache")
    # Kept under its name beside the cache it filled, so a start there compiles nothing ahead.
    assert KernelManifest.load(root / "kernel-manifests" / recorded.name) == KernelManifest.load(recorded)


def test_compile_kernels_refuses_what_it_cannot_use(tmp_path):
    not_manifest = tmp_path / "notes.json"
    not_manifest.write_text("{}")
    done = _cli(str(not_manifest), cache_root=tmp_path / "cache")
    assert done.returncode == 2 and "not a kernel manifest" in done.stderr
    other_triton = tmp_path / "old.json"
    KernelManifest("0.0.1", H100, []).save(other_triton)
    done = _cli(str(other_triton), cache_root=tmp_path / "cache")
    assert done.returncode == 2 and "recorded with Triton 0.0.1" in done.stderr
