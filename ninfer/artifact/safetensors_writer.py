"""Write a safetensors file tensor by tensor, with a SHA-256 of each tensor's bytes.

safetensors' own save_file serialises every tensor to bytes in memory first, doubling the
host memory a 27B model needs to be written. The format is one little-endian u64 header
length, a JSON header (dtype, shape and byte range of each tensor, plus a string-to-string
`__metadata__`) and the tensors' bytes; this writer streams the bytes straight from each
tensor. The digests go into the metadata under `DIGESTS_KEY`: the header is first written
with placeholder digests of the same length and rewritten once the bytes are known.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import torch

DIGESTS_KEY = "sha256.json"
_DIGEST_PLACEHOLDER = "0" * 64
_HEADER_ALIGNMENT = 8  # the header is padded with spaces so tensor data starts 8-byte aligned
_WRITE_BLOCK = 64 << 20  # bytes handed to the hash and the file per call

DTYPE_NAMES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order (a contiguous copy only when it is not contiguous)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def write_safetensors(
    path: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    on_bytes: Callable[[int], None] | None = None,
) -> dict[str, str]:
    """Write `tensors` (in the given order) and `metadata` to `path` atomically (a temporary
    file renamed into place); returns each tensor's SHA-256, also stored under DIGESTS_KEY.
    on_bytes: called with each block's size as it is written (a progress bar)."""
    if DIGESTS_KEY in metadata:
        raise ValueError(f"metadata key {DIGESTS_KEY!r} is reserved for the digests")
    entries: dict[str, dict[str, object]] = {}
    offset = 0
    for name, tensor in tensors.items():
        dtype = DTYPE_NAMES.get(tensor.dtype)
        if dtype is None:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors name")
        size = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    digests = {name: _DIGEST_PLACEHOLDER for name in tensors}
    placeholder = _header(entries, metadata, digests)
    temporary = path.with_name(f".{path.name}.partial")
    try:
        with temporary.open("wb") as handle:
            handle.write(placeholder)
            for name, tensor in tensors.items():
                hasher = hashlib.sha256()
                data = tensor_bytes(tensor)
                for start in range(0, len(data), _WRITE_BLOCK):
                    block = data[start : start + _WRITE_BLOCK]
                    hasher.update(block)
                    handle.write(block)
                    if on_bytes is not None:
                        on_bytes(len(block))
                digests[name] = hasher.hexdigest()
            header = _header(entries, metadata, digests)
            if len(header) != len(placeholder):  # cannot happen: hex digests have a fixed length
                raise AssertionError("safetensors header changed length")
            handle.seek(0)
            handle.write(header)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return digests


def _header(entries: dict[str, dict[str, object]], metadata: dict[str, str], digests: dict[str, str]) -> bytes:
    document = {"__metadata__": {**metadata, DIGESTS_KEY: json.dumps(digests)}, **entries}
    text = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + 8) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text
