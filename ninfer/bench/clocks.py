"""The SM clock each benchmark case ran at, sampled from NVML on a background thread.

The H200s measured in docs/performance.md ran under a software power cap that moved the
SM clock between about 1.45 and 1.98 GHz during long runs; prefill is bound by the matrix
units, so its rate (and its fraction of a matrix rate measured at another moment) is only
readable next to the clock.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable

import torch

log = logging.getLogger("ninfer.bench")

_NVML_CLOCK_SM = 1  # pynvml.NVML_CLOCK_SM


def nvml_sm_clock_reader(device: torch.device) -> Callable[[], int] | None:
    """A function returning `device`'s current SM clock in MHz, or None without NVML
    (nvidia-ml-py, the `gpu` extra) or when NVML cannot see the device."""
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = torch.cuda.get_device_properties(device).uuid
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        pynvml.nvmlDeviceGetClockInfo(handle, _NVML_CLOCK_SM)
    except Exception as exc:  # noqa: BLE001 - missing library, driver or device all mean "no clocks"
        log.warning("SM clocks not recorded (%s: %s)", type(exc).__name__, exc)
        return None
    return lambda: pynvml.nvmlDeviceGetClockInfo(handle, _NVML_CLOCK_SM)


class ClockSampler:
    """Samples `read_mhz` every `interval_s` until stopped; `median_mhz(start, end)` is the
    median over a time.perf_counter() window."""

    def __init__(self, read_mhz: Callable[[], int] | None, interval_s: float = 0.05):
        self._read_mhz = read_mhz
        self._interval_s = interval_s
        self._samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ClockSampler:
        if self._read_mhz is not None:
            self._thread = threading.Thread(target=self._run, name="sm-clock-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._samples.append((time.perf_counter(), self._read_mhz()))
            self._stop.wait(self._interval_s)

    def median_mhz(self, start: float, end: float) -> float | None:
        """None without a reader; a window shorter than the interval takes the last sample
        before its end."""
        if self._read_mhz is None:
            return None
        samples = list(self._samples)
        inside = [mhz for t, mhz in samples if start <= t <= end]
        if inside:
            return float(statistics.median(inside))
        before = [mhz for t, mhz in samples if t <= end]
        return float(before[-1]) if before else None
