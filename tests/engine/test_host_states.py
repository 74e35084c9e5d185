"""HostStates: a spilled StateImage (and its logits) comes back bit for bit, even when the
device slot is overwritten right after the spill is enqueued (stream order, no host wait)."""

from __future__ import annotations

import pytest
import torch

from ninfer.engine.cache.host_states import HostStates
from ninfer.models.state_cache import StateCache

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_spill_then_overwrite_then_restore_is_exact(device: str) -> None:
    torch.manual_seed(0)
    states = StateCache.allocate(3, 4, 24, 4, 2, 8, 16, torch.bfloat16, device)
    states.conv.normal_()
    states.recurrent.normal_()
    logits = torch.randn(4, 50, device=device)
    host = HostStates(states, logits, num_slots=2)
    assert host.conv.is_pinned() == (device == "cuda")
    want = (states.conv[:, 1].clone(), states.recurrent[:, 1].clone(), logits[1].clone())
    host.spill(device_slot=1, host_slot=1)
    # Reuse the freed device slot at once, as the next action or forward may.
    states.reset(1)
    logits[1].fill_(-1.0)
    states.conv[:, 1].add_(3.0)
    host.restore(host_slot=1, device_slot=2)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(states.conv[:, 2], want[0])
    assert torch.equal(states.recurrent[:, 2], want[1])
    assert torch.equal(logits[2], want[2])
    assert host.bytes_per_slot == want[0].numel() * 2 + want[1].numel() * 4 + want[2].numel() * 4


def test_an_empty_host_tier_still_reports_its_slot_size() -> None:
    states = StateCache.allocate(2, 3, 8, 4, 2, 4, 4, torch.float32)
    host = HostStates(states, torch.zeros(3, 10), num_slots=0)  # --no-prefix-reuse or --host-state-slots 0
    assert host.num_slots == 0 and host.bytes_per_slot == (2 * 8 * 3 + 2 * 2 * 4 * 4 + 10) * 4


def test_attention_only_models_keep_only_logits() -> None:
    logits = torch.arange(3 * 5, dtype=torch.float32).view(3, 5)
    host = HostStates(None, logits, num_slots=1)
    host.spill(0, 0)
    host.restore(0, 2)
    assert torch.equal(logits[2], logits[0]) and host.bytes_per_slot == 5 * 4
