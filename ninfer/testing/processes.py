"""Finding ninfer-serve's processes from the outside (Linux /proc), for tests and benchmarks."""

from __future__ import annotations

import os
import re


def engine_process_of(pid: int) -> int:
    """The engine process the API process `pid` spawned (multiprocessing's spawn_main child)."""
    children = spawned_children(pid)
    if not children:
        raise LookupError(f"process {pid} has no engine process")
    return children[0]


def spawned_children(pid: int) -> list[int]:
    """The processes `pid` spawned with multiprocessing (spawn_main children), lowest pid first: an
    API process's engine process, or an engine's tensor-parallel followers."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = open(f"/proc/{entry}/status").read()
            command = open(f"/proc/{entry}/cmdline").read()
        except OSError:
            continue
        if f"PPid:\t{pid}\n" in status and "spawn_main" in command:
            children.append(int(entry))
    return sorted(children)


def rss_mib(pid: int) -> float:
    """Resident memory of a process, MiB."""
    status = open(f"/proc/{pid}/status").read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024
