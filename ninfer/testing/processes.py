"""Finding ninfer-serve's processes from the outside (Linux /proc), for tests and benchmarks."""

from __future__ import annotations

import os
import re


def engine_process_of(pid: int) -> int:
    """The engine process the API process `pid` spawned (multiprocessing's spawn_main child)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = open(f"/proc/{entry}/status").read()
            command = open(f"/proc/{entry}/cmdline").read()
        except OSError:
            continue
        if f"PPid:\t{pid}\n" in status and "spawn_main" in command:
            return int(entry)
    raise LookupError(f"process {pid} has no engine process")


def rss_mib(pid: int) -> float:
    """Resident memory of a process, MiB."""
    status = open(f"/proc/{pid}/status").read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024
