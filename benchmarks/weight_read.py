"""Weight read: how fast a safetensors checkpoint's bytes reach the GPU, by read path.

What a start-up's "model loaded in" is made of, without the model: every tensor of the
checkpoint (up to --gib) copied into one device buffer, by each path:
  mmap-copy     safetensors' mmap'd tensor copied to the device (what the loader did: the
                driver stages pageable memory and the copy page-faults through the mapping)
  pread-pinned  N threads read the file with pread into a ring of pinned chunks, each chunk copied
                to the device asynchronously while the next ones are read (what a GPU load does:
                artifact/pinned_reader.py)
Reads the page cache when the checkpoint is on tmpfs (/dev/shm) or was read before: run it after
a load has read the files once to time the copy, not the disk.

--beside-bytecode: every path runs beside a thread executing Python bytecode, as an engine start's
imports run beside its load, and pread-pinned also runs at Python's default GIL switch interval
(5 ms) beside the reader's own (pinned_reader.GIL_SWITCH_SECONDS).

  python3 benchmarks/weight_read.py /dev/shm/q27 --gib 16 --threads 1,4,8 [--beside-bytecode]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from ninfer.artifact import pinned_reader
from ninfer.artifact.pinned_reader import PinnedReader, tensor_extents


def files_of(model: Path) -> list[Path]:
    index = model / "model.safetensors.index.json"
    if index.is_file():
        return sorted({model / shard for shard in json.loads(index.read_text())["weight_map"].values()})
    return [model / "model.safetensors"]


def mmap_copy(files: list[Path], limit: int, out: torch.Tensor) -> int:
    done = 0
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name).reshape(-1).view(torch.uint8)
                if done + tensor.numel() > limit:
                    return done
                out[done : done + tensor.numel()].copy_(tensor)
                done += tensor.numel()
    return done


def pread_pinned(files: list[Path], limit: int, out: torch.Tensor, threads: int) -> int:
    extents = []
    total = 0
    for extent in (e for file in files for e in tensor_extents(file)):
        if total + extent.nbytes > limit:
            break
        extents.append(extent)
        total += extent.nbytes
    done = 0
    with PinnedReader(out.device, threads=threads) as reader:
        for extent, device_bytes in reader.read(extents):
            out[done : done + extent.nbytes].copy_(device_bytes)
            done += extent.nbytes
    return done


@contextmanager
def bytecode_thread(running: bool):
    """Within: a thread running Python bytecode (it holds the GIL until made to switch)."""
    stop = threading.Event()

    def spin() -> None:
        total = 0
        while not stop.is_set():
            for i in range(10_000):
                total += i * i

    thread = threading.Thread(target=spin, daemon=True)
    if running:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if running:
            thread.join()


def at_switch_interval(seconds: float, run):
    def with_interval() -> int:
        kept = pinned_reader.GIL_SWITCH_SECONDS
        pinned_reader.GIL_SWITCH_SECONDS = seconds
        try:
            return run()
        finally:
            pinned_reader.GIL_SWITCH_SECONDS = kept

    return with_interval


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a directory of safetensors files")
    parser.add_argument("--gib", type=float, default=16.0, help="read at most this much (default 16)")
    parser.add_argument("--threads", default="1,4,8", help="pread-pinned reader threads to try")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--beside-bytecode", action="store_true",
                        help="run beside a thread executing bytecode; pread-pinned also at a 5 ms GIL switch")
    args = parser.parse_args()
    device = torch.device("cuda")
    files = files_of(args.model)
    limit = int(args.gib * (1 << 30))
    out = torch.empty(limit, dtype=torch.uint8, device=device)
    mmap_copy(files, 1 << 30, out)  # CUDA and the page cache's first touch
    paths = [("mmap-copy", lambda: mmap_copy(files, limit, out))]
    for threads in (int(t) for t in args.threads.split(",")):
        read = lambda threads=threads: pread_pinned(files, limit, out, threads)  # noqa: E731
        paths.append((f"pread-pinned x{threads}", read))
        if args.beside_bytecode:
            paths.append((f"pread-pinned x{threads}, 5 ms switch", at_switch_interval(0.005, read)))
    print(f"{'path':<32} {'GB':>6} {'s':>7} {'GB/s':>7}" + ("  (beside a bytecode thread)" if args.beside_bytecode else ""))
    for name, run in paths:
        best = None
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            with bytecode_thread(args.beside_bytecode):
                started = time.perf_counter()
                moved = run()
                torch.cuda.synchronize()
                elapsed = time.perf_counter() - started
            best = elapsed if best is None else min(best, elapsed)
        print(f"{name:<32} {moved / 1e9:>6.1f} {best:>7.2f} {moved / 1e9 / best:>7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
