"""KvSizingRecords: what the --kv-capacity auto probe measured, kept across restarts.

The probe builds an engine with a small pool, captures its CUDA graphs and runs the warm-up to
measure the worst step's and the graphs' device memory: a large share of a restart, for figures
that depend only on the model, the engine's step shapes, the device, the libraries and NInfer's
own code. They are kept in the cache folder under a digest of all of those (ProbeKey); a restart
with the same digest sizes the pool from them and the memory free now. The final engine's warm-up
still measures its step workspace, and a record that it exceeds is dropped (builder.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from ninfer.assets.qwen_tokenizer import write_atomically

log = logging.getLogger("ninfer.engine")

_FORMAT = 1  # bumped when the record's fields change meaning
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ProbeMeasure:
    worst_step_bytes: int  # device memory the warm-up's worst step reserved beyond pools and graphs
    graph_bytes: int  # device memory the probe's CUDA graphs reserved
    worst_step_tokens: int  # tokens of that worst step


@functools.cache
def source_digest() -> str:
    """A digest of NInfer's Python sources: a record outlives no change to the code that measured it."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE_ROOT.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE_ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def probe_key(*parts: str) -> str:
    """The digest a record is kept under: `parts` (the probe's engine configuration, the model's
    configuration and weight layout, the device and library versions) and the source digest."""
    digest = hashlib.sha256(f"format={_FORMAT}".encode())
    for part in (*parts, source_digest()):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()


class KvSizingRecords:
    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def _path(self, key: str) -> Path:
        return self.folder / f"{key[:32]}.json"

    def load(self, key: str) -> ProbeMeasure | None:
        """The measure kept under `key`; None when there is none or it cannot be read."""
        try:
            stored = json.loads(self._path(key).read_text())
            if stored.get("key") != key:
                return None
            return ProbeMeasure(**stored["measure"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as error:
            log.warning("KV sizing record %s unreadable (%s): the probe runs", self._path(key), error)
            return None

    def store(self, key: str, measure: ProbeMeasure) -> None:
        """Keep `measure` under `key`; a folder that cannot be written costs the next start a probe."""
        path = self._path(key)
        try:
            write_atomically(path, json.dumps({"key": key, "measure": asdict(measure)}))
        except OSError as error:
            log.warning("KV sizing record not kept in %s (%s)", path.parent, error)

    def drop(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as error:
            log.warning("KV sizing record %s not removed (%s)", self._path(key), error)


# The final engine's step workspace may exceed the probe's worst step by this much (allocator
# rounding) and keep the record: the pool leaves 1 GiB of headroom besides.
WORKSPACE_SLACK_BYTES = 256 << 20


@dataclass(frozen=True)
class AutoSizing:
    """The figures one auto sizing used, and where they are kept."""

    records: KvSizingRecords
    key: str
    measure: ProbeMeasure

    def confirm(self, workspace_bytes: int) -> None:
        """The final engine's warm-up reserved `workspace_bytes` beyond its pools and graphs: a
        record it exceeds is dropped, so the next start probes again."""
        if workspace_bytes > self.measure.worst_step_bytes + WORKSPACE_SLACK_BYTES:
            log.warning(
                "the step workspace (%.2f GiB) exceeds the KV sizing's worst step (%.2f GiB): its record"
                " is dropped and the next start measures again", workspace_bytes / (1 << 30),
                self.measure.worst_step_bytes / (1 << 30),
            )
            self.records.drop(self.key)
