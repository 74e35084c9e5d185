"""The bench's NVML SM clock reader on the GPU: a plausible clock, and the sampler's window."""

from __future__ import annotations

import time

import pytest
import torch

from ninfer.bench.clocks import ClockSampler, nvml_sm_clock_reader

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_nvml_reads_the_sm_clock_under_load() -> None:
    read_mhz = nvml_sm_clock_reader(torch.device("cuda", torch.cuda.current_device()))
    assert read_mhz is not None, "nvidia-ml-py (the gpu extra) should be installed on GPU machines"
    sampler = ClockSampler(read_mhz, interval_s=0.01).start()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    for _ in range(100):
        a @ a
    torch.cuda.synchronize()
    end = time.perf_counter()
    sampler.stop()
    mhz = sampler.median_mhz(start, end)
    assert mhz is not None and 300 <= mhz <= 3000
