"""PinnedReader: a checkpoint's tensors read by threads through pinned chunks onto the GPU.

Copying safetensors' memory-mapped tensors to a GPU is bounded by the host (5-7 GB/s measured,
benchmarks/weight_read.py): the driver stages pageable memory through its own buffer, and the
copy faults the mapping in one page at a time. Here reader threads pread each tensor's bytes
(the kernel copies from the page cache; pread releases the GIL) into a ring of pinned chunks,
allocated once, and each chunk is copied to the device asynchronously while the next ones are
read. Pinned memory is not allocated per tensor: page-locking runs at ~3 GB/s on one thread and
~12 GB/s on eight (engine/pinned_allocator.py), below the ring's ~25 GB/s. The device holds up to two tensors on their way to the
weights (the one the loader writes, the next being read).

Every chunk passes the GIL between the readers and the thread that queues its copy, and an
engine start imports its other modules on a thread meanwhile (engine/background_imports.py):
with Python's 5 ms switch interval each hand-off can wait that long behind the importing
thread. While a reader is open the interval is 0.5 ms (2 CPUs, 3 GB from the page cache beside
a thread running bytecode: 4.3-4.7 GB/s at 5 ms, 6.1-7.0 at 0.5 ms; 10.5 alone).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from ninfer.host_cpus import usable_cpus

CHUNK_BYTES = 32 << 20  # one pread and one copy: large enough that neither's fixed cost shows
GIL_SWITCH_SECONDS = 0.0005  # while reading: how long a thread holding the GIL keeps it from a waiting one
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
    available = usable_cpus()
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


@dataclass
class _Piece:
    extent_index: int
    start: int  # within the extent
    length: int
    chunk: int
    read: Future | None = None


class PinnedReader:
    """Reads extents onto a device through a ring of chunks, pinned for a CUDA device (use as a
    context manager). On the CPU (tests) the same pipeline copies synchronously."""

    def __init__(self, device: torch.device, threads: int = 8, chunk_bytes: int = CHUNK_BYTES):
        self.device = torch.device(device)
        self.chunk_bytes = chunk_bytes
        pinned = self.device.type == "cuda"
        # Twice the readers: each reader has a chunk to fill while the previous ones copy.
        self.chunks = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(2 * threads)]
        self.copied = [None] * len(self.chunks)  # the event after each chunk's last copy
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="weight-read")
        self.files: dict[Path, int] = {}
        self._switch_interval = sys.getswitchinterval()  # the process's own, back at close()
        sys.setswitchinterval(min(self._switch_interval, GIL_SWITCH_SECONDS))

    def __enter__(self) -> PinnedReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for descriptor in self.files.values():
            os.close(descriptor)
        self.files.clear()
        sys.setswitchinterval(self._switch_interval)

    def read(self, extents: Iterable[TensorExtent]) -> Iterator[tuple[TensorExtent, torch.Tensor]]:
        """-> (extent, its bytes on the device as uint8), in the given order. A CUDA tensor is
        filled by copies on the current stream: work queued after it on that stream sees the bytes."""
        device = self.device
        on_cuda = device.type == "cuda"
        extents = list(extents)
        for extent in extents:
            if extent.file not in self.files:
                self.files[extent.file] = os.open(extent.file, os.O_RDONLY)
        pieces = deque(
            _Piece(index, start, min(self.chunk_bytes, extent.nbytes - start), 0)
            for index, extent in enumerate(extents)
            for start in range(0, max(extent.nbytes, 1), self.chunk_bytes)
        )
        stream = torch.cuda.current_stream(device) if on_cuda else None
        in_flight: deque[_Piece] = deque()
        next_chunk = 0
        current: torch.Tensor | None = None
        current_index = -1

        def submit() -> None:
            nonlocal next_chunk
            piece = pieces.popleft()
            piece.chunk = next_chunk
            next_chunk = (next_chunk + 1) % len(self.chunks)
            if self.copied[piece.chunk] is not None:
                self.copied[piece.chunk].synchronize()  # its last copy has left the chunk
            piece.read = self.pool.submit(self._read, extents[piece.extent_index], piece)
            in_flight.append(piece)

        while pieces and len(in_flight) < len(self.chunks):
            submit()
        while in_flight:
            piece = in_flight.popleft()
            if piece.extent_index != current_index:
                if current is not None:
                    yield extents[current_index], current
                current_index = piece.extent_index
                current = torch.empty(extents[current_index].nbytes, dtype=torch.uint8, device=device)
            piece.read.result()
            if piece.length:
                current[piece.start : piece.start + piece.length].copy_(
                    self.chunks[piece.chunk][: piece.length], non_blocking=on_cuda
                )
            if on_cuda:
                event = torch.cuda.Event()
                event.record(stream)
                self.copied[piece.chunk] = event
            if pieces:
                submit()
        if current is not None:
            yield extents[current_index], current

    def _read(self, extent: TensorExtent, piece: _Piece) -> None:
        descriptor = self.files[extent.file]
        view = memoryview(self.chunks[piece.chunk].numpy())[: piece.length]
        done = 0
        while done < piece.length:
            got = os.preadv(descriptor, [view[done:]], extent.offset + piece.start + done)
            if got == 0:
                raise OSError(f"{extent.file}: ends inside tensor {extent.name!r}")
            done += got
