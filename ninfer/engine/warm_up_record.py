"""WarmUpRecords: which full warm-ups ran to the end, kept across restarts.

A full warm-up compiles and autotunes every kernel its configuration's steps use into the kernel
cache; a start with the same plan, code, device, libraries and kernel cache then needs only the
short warm-up (warm_up.py). Kept in the cache folder as one small file per digest (the digest is
built like the KV sizing record's: kv_sizing_record.probe_key).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ninfer.assets.qwen_tokenizer import write_atomically

log = logging.getLogger("ninfer.engine")


class WarmUpRecords:
    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def _path(self, key: str) -> Path:
        return self.folder / f"{key[:32]}.key"

    def has(self, key: str) -> bool:
        """Whether a full warm-up ran to the end under `key`."""
        try:
            return self._path(key).read_text() == key
        except OSError:
            return False

    def store(self, key: str) -> None:
        """Note that a full warm-up ran to the end under `key`; a folder that cannot be written
        costs the next start a full warm-up."""
        path = self._path(key)
        try:
            write_atomically(path, key)
        except OSError as error:
            log.warning("warm-up record not kept in %s (%s)", path.parent, error)
