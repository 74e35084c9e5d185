"""HostKV: spilled KV pages come back bit for bit into other device pages, whatever runs of host
pages they occupy, even when the device pages are overwritten right after the spill."""

from __future__ import annotations

import pytest
import torch

from ninfer.engine.cache.host_kv import HostKV, _runs
from ninfer.models.kv_cache import KVCache

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]


def test_runs_of_consecutive_host_pages():
    assert _runs((4, 5, 6, 9, 2, 3)) == [(4, 0, 3), (9, 3, 1), (2, 4, 2)]
    assert _runs(()) == []


@pytest.mark.parametrize("device", DEVICES)
def test_spill_then_overwrite_then_restore_is_exact(device: str) -> None:
    torch.manual_seed(0)
    kv = KVCache.allocate(3, 12, 4, 2, 8, torch.bfloat16, device)
    kv.k.normal_()
    kv.v.normal_()
    host = HostKV(kv, num_pages=10)
    device_pages, host_pages = (7, 2, 5, 11), (3, 4, 9, 0)  # host runs: 3-4, 9, 0
    want_k, want_v = kv.k[:, list(device_pages)].clone(), kv.v[:, list(device_pages)].clone()
    host.spill(device_pages, host_pages)
    kv.k.zero_()  # the device pages are reused at once
    kv.v.fill_(1.0)
    restored = (1, 0, 10, 6)
    host.restore(host_pages, restored)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(kv.k[:, list(restored)], want_k) and torch.equal(kv.v[:, list(restored)], want_v)
    assert HostKV.page_bytes(kv) == 2 * 3 * 4 * 2 * 8 * 2
