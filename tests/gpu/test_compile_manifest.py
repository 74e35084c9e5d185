"""The kernel manifest on the GPU: an engine start on an empty kernel cache records what it
compiled; a start on another empty cache that finds that record packaged compiles it ahead on
worker processes (without CUDA), and its own launches then compile nothing new; the autotuners
find the recorded choices instead of benchmarking again."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_BUILD = """
import logging, sys
from pathlib import Path
import ninfer.kernels.compile_manifest as manifests
import ninfer.engine.start_compiles as start_compiles
from ninfer.config import EngineConfig, EngineSpec
from ninfer.engine.builder import build_engine_core
artifact, packaged, preload = sys.argv[1], sys.argv[2], sys.argv[3]
logging.basicConfig(level=logging.INFO)
if packaged:
    manifests.PACKAGED = Path(packaged)
start_compiles.PRELOAD_KERNELS = preload == "preload"
build_engine_core(EngineSpec(artifact, EngineConfig(device="cuda", max_context=512, log_stats_interval_ms=0)))
"""


def _build(artifact: str, root: Path, packaged: str = "", preload: bool = False) -> tuple[set[str], dict[str, str], str]:
    """-> (the kernels in the start's kernel cache, by cache key; its autotuning results by path; its log)."""
    env = {**os.environ, "NINFER_CACHE_DIR": str(root), "TRITON_CACHE_DIR": str(root / "triton")}
    argv = [sys.executable, "-c", _BUILD, artifact, packaged, "preload" if preload else ""]
    done = subprocess.run(argv, capture_output=True, text=True,
                          timeout=900, env=env, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = {path.parent.name for path in (root / "triton").rglob("*.cubin")}
    tuned = {str(path.relative_to(root)): path.read_text() for path in (root / "triton").glob("*/*.autotune.json")}
    return kernels, tuned, done.stderr


@pytest.mark.parametrize("preload", [False, True], ids=["compiled", "compiled-and-preloaded"])
def test_a_recorded_manifest_compiled_ahead_leaves_nothing_to_compile_at_launch(tmp_path, preload):
    """preload (PRELOAD_KERNELS): each kernel also comes into the process as its compile finishes."""
    artifact = str(make_tiny_qwen3_5(tmp_path / "model"))
    first_kernels, first_tuned, _ = _build(artifact, tmp_path / "first")
    (recorded,) = (tmp_path / "first" / "kernel-manifests").glob("*.json")
    packaged = tmp_path / "packaged"
    packaged.mkdir()
    (packaged / recorded.name).write_text(recorded.read_text())

    ahead_kernels, ahead_tuned, log = _build(artifact, tmp_path / "second", str(packaged), preload=preload)
    assert "GPU kernels compiled ahead" in log and "left to compile" not in log
    if preload:
        compiled = re.search(r"(\d+) GPU kernels compiled ahead", log)
        preloaded = re.search(r"(\d+) GPU kernels brought into the process as their compiles finished", log)
        assert compiled and preloaded and compiled.group(1) == preloaded.group(1), log[-3000:]
        assert "left to their launch" not in log
    assert first_kernels and ahead_kernels == first_kernels  # under the keys the launches looked up
    # The same files with the same timings: found under the autotuners' keys, not benchmarked again.
    assert first_tuned and ahead_tuned == first_tuned


def test_a_restart_brings_the_recorded_kernels_in_beside_the_load(tmp_path):
    """PRELOAD_KERNELS: a start that finds this machine's manifest loads its kernels into the
    process on a thread while the weights load; every entry loads, and the start compiles nothing new."""
    artifact = str(make_tiny_qwen3_5(tmp_path / "model"))
    first_kernels, _, _ = _build(artifact, tmp_path / "cache")
    restart_kernels, _, log = _build(artifact, tmp_path / "cache", preload=True)
    assert "GPU kernels brought into the process from the kernel cache" in log, log[-3000:]
    assert "left to their launch" not in log
    assert restart_kernels == first_kernels
