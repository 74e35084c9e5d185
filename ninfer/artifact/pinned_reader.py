"""PinnedReader: a checkpoint's tensors read ahead by threads into pinned host memory.

Copying safetensors' memory-mapped tensors to a GPU is bounded by the host (4.7 GB/s measured,
benchmarks/weight_read.py): the driver stages pageable memory through its own buffer, and the
copy faults the mapping in one page at a time. Here reader threads pread each tensor's bytes
into pinned memory (the kernel copies from the page cache; pread releases the GIL) ahead of
the loader, whose copies to the device then run at the bus's rate.
"""

from __future__ import annotations

import json
import os
import struct
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

PIECE_BYTES = 32 << 20  # one pread: large enough that its fixed cost does not show
AHEAD_BYTES = 2 << 30  # read this far past the tensor the consumer holds
_HEADER_LENGTH_BYTES = 8  # a safetensors file starts with its JSON header's length, little-endian u64

# safetensors' dtype names -> torch dtypes (those a checkpoint holds)
TORCH_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}  # fmt: skip


def reader_threads() -> int:
    """Reader threads for a load: half the CPUs this process may use, 2 to 8 (past ~8 the page
    cache's copy bandwidth is the limit, and the engine's own thread needs a CPU)."""
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return max(2, min(8, available // 2))


@dataclass(frozen=True)
class TensorExtent:
    """Where one tensor's bytes lie in its file."""

    file: Path
    name: str
    dtype: str  # safetensors' name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # from the file's start
    nbytes: int

    def view(self, raw: torch.Tensor) -> torch.Tensor:
        """raw: the extent's bytes as uint8 -> the tensor they hold."""
        return raw.view(TORCH_DTYPES[self.dtype]).view(self.shape)


def tensor_extents(file: Path) -> list[TensorExtent]:
    """Every tensor's extent in a safetensors file, in file order."""
    with open(file, "rb") as handle:
        (header_length,) = struct.unpack("<Q", handle.read(_HEADER_LENGTH_BYTES))
        header = json.loads(handle.read(header_length))
    data_start = _HEADER_LENGTH_BYTES + header_length
    extents = [
        TensorExtent(file, name, entry["dtype"], tuple(entry["shape"]), data_start + entry["data_offsets"][0],
                     entry["data_offsets"][1] - entry["data_offsets"][0])  # fmt: skip
        for name, entry in header.items()
        if name != "__metadata__"
    ]
    return sorted(extents, key=lambda extent: extent.offset)


class PinnedReader:
    """Reads whole tensors into pinned host memory (plain memory for a CPU load), ahead of the
    consumer (use as a context manager).

    Each tensor is read by the threads in PIECE_BYTES pieces; tensors are read in order, up to
    `ahead_bytes` past the one the consumer holds. A tensor is the consumer's once yielded (it
    may keep it); its copy to the device is the loader's (fast from pinned memory), so the device
    holds nothing but the weights as they are written, as with memory-mapped tensors. The host
    allocator keeps freed pinned blocks for the next tensors of their size (see release_pinned)."""

    def __init__(self, pinned: bool, threads: int = 8, ahead_bytes: int = AHEAD_BYTES, piece_bytes: int = PIECE_BYTES):
        self.pinned = pinned
        self.ahead_bytes = ahead_bytes
        self.piece_bytes = piece_bytes
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="weight-read")
        self.files: dict[Path, int] = {}

    def __enter__(self) -> PinnedReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for descriptor in self.files.values():
            os.close(descriptor)
        self.files.clear()

    def read(self, extents: Iterable[TensorExtent]) -> Iterator[tuple[TensorExtent, torch.Tensor]]:
        """-> (extent, its bytes as a uint8 host tensor), in the given order."""
        extents = list(extents)
        for extent in extents:
            if extent.file not in self.files:
                self.files[extent.file] = os.open(extent.file, os.O_RDONLY)
        queued: deque[tuple[TensorExtent, torch.Tensor, list[Future]]] = deque()
        queued_bytes = 0
        upcoming = iter(extents)
        exhausted = False
        while True:
            # Read ahead: the next tensors while they fit the budget (always the next one).
            while not exhausted and (not queued or queued_bytes < self.ahead_bytes):
                extent = next(upcoming, None)
                if extent is None:
                    exhausted = True
                    break
                buffer = torch.empty(extent.nbytes, dtype=torch.uint8, pin_memory=self.pinned)
                reads = [
                    self.pool.submit(self._read, extent, buffer, start, min(self.piece_bytes, extent.nbytes - start))
                    for start in range(0, extent.nbytes, self.piece_bytes)
                ]
                queued.append((extent, buffer, reads))
                queued_bytes += extent.nbytes
            if not queued:
                return
            extent, buffer, reads = queued.popleft()
            for read in reads:
                read.result()
            queued_bytes -= extent.nbytes
            yield extent, buffer

    def _read(self, extent: TensorExtent, buffer: torch.Tensor, start: int, length: int) -> None:
        view = memoryview(buffer.numpy())[start : start + length]
        done = 0
        while done < length:
            got = os.preadv(self.files[extent.file], [view[done:]], extent.offset + start + done)
            if got == 0:
                raise OSError(f"{extent.file}: ends inside tensor {extent.name!r}")
            done += got


def release_pinned() -> None:
    """Return the pinned blocks a load left cached to the system (a private torch call, where it exists)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()
