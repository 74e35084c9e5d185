"""The bench's SM clock sampler (with a stand-in for NVML) and the clock column of its report."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from ninfer.bench.clocks import ClockSampler, nvml_sm_clock_reader
from ninfer.bench.report import markdown_table


def test_median_over_a_window_of_samples() -> None:
    readings = itertools.count(1000, 10)  # 1000, 1010, ... MHz, one per sample
    sampler = ClockSampler(lambda: next(readings), interval_s=0.002).start()
    time.sleep(0.05)
    start = time.perf_counter()
    time.sleep(0.05)
    end = time.perf_counter()
    time.sleep(0.02)
    sampler.stop()
    inside = [mhz for t, mhz in sampler._samples if start <= t <= end]
    assert len(inside) >= 3
    # Consecutive readings of an arithmetic sequence: the median is the midpoint of the window's.
    assert sampler.median_mhz(start, end) == (min(inside) + max(inside)) / 2
    assert min(inside) > sampler._samples[0][1]  # the samples before the window are not in it


def test_a_window_between_samples_takes_the_last_sample_before_it() -> None:
    sampler = ClockSampler(lambda: 1830, interval_s=10.0).start()  # one sample, then a long wait
    time.sleep(0.01)
    start = time.perf_counter()
    end = start + 1e-6
    sampler.stop()
    assert sampler.median_mhz(start, end) == 1830.0
    assert sampler.median_mhz(0.0, sampler._samples[0][0] - 1.0) is None  # nothing before the window


def test_without_a_reader_there_is_no_clock() -> None:
    sampler = ClockSampler(None).start()
    sampler.stop()
    assert sampler.median_mhz(0.0, time.perf_counter()) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_no_nvml_reader_without_a_gpu() -> None:
    assert nvml_sm_clock_reader(torch.device("cuda", 0)) is None


def _results(matmul_clock: float | None, case_clock: float | None) -> dict:
    return {
        "device": "NVIDIA H200",
        "torch": "2.11",
        "ceilings": {"copy_bytes_per_s": 4.2e12, "bf16_flops_per_s": 7.5e14, "name": "NVIDIA H200",
                     "matmul_sm_clock_mhz": matmul_clock},
        "results": [{"shape": "27b", "weights": "fp8", "kind": "prefill", "batch": 1, "tokens": 8192,
                     "tokens_per_s": 17000.0, "roofline_tokens_per_s": 14000.0, "fraction_of_roofline": 17 / 14,
                     "peak_memory_gib": 29.7, "note": "", "sm_clock_mhz": case_clock}],
    }


def test_report_shows_the_clocks_when_recorded() -> None:
    table = markdown_table(_results(1980.0, 1755.0))
    assert "bf16 matmul 750 TFLOP/s at SM 1980 MHz" in table
    assert table.splitlines()[2].endswith("| SM MHz |")
    assert table.splitlines()[-1].endswith("| 29.7 | 1755 |")


def test_report_without_clocks_and_from_older_runs() -> None:
    table = markdown_table(_results(None, None))
    assert "at SM" not in table and table.splitlines()[-1].endswith("| 29.7 | – |")
    older = _results(None, None)  # a JSON written before clocks were recorded
    del older["ceilings"]["matmul_sm_clock_mhz"], older["results"][0]["sm_clock_mhz"]
    assert markdown_table(older).splitlines()[-1].endswith("| – |")
