"""causal_conv1d reference vs transformers' torch fallbacks, varlen batches and chained chunks."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn as hf_conv_fn
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update as hf_conv_update

from ninfer.kernels.causal_conv1d import causal_conv1d, causal_conv1d_update

CHANNELS = 24
KERNEL = 4
LENGTHS = (1, 3, 63, 64, 65, 130)


def _inputs(length: int, seed: int, num_slots: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, CHANNELS, generator=gen)
    weight = torch.randn(CHANNELS, KERNEL, generator=gen) * 0.5
    state = torch.randn(num_slots, CHANNELS, KERNEL - 1, generator=gen)
    return x, weight, state


def _hf_with_state(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cached path: its state keeps K columns; the oldest one never reaches the outputs."""
    hf_state = torch.cat((torch.zeros(1, CHANNELS, 1), state.unsqueeze(0)), dim=-1).clone()
    out = hf_conv_update(x.t().unsqueeze(0), hf_state, weight, None, "silu")
    return out[0].t(), hf_state[0, :, 1:]


@pytest.mark.parametrize("length", LENGTHS)
def test_fresh_sequence_matches_transformers(length: int) -> None:
    x, weight, _ = _inputs(length, seed=length)
    state = torch.zeros(1, CHANNELS, KERNEL - 1)
    out = causal_conv1d(x, weight, state, torch.tensor([0]), (length,))
    expected = hf_conv_fn(x.t().unsqueeze(0), weight, None, activation="silu")[0].t()
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    # The state keeps the last K-1 pre-conv inputs (zero-padded on the left for short sequences).
    padded = torch.cat((torch.zeros(KERNEL - 1, CHANNELS), x))
    torch.testing.assert_close(state[0], padded[-(KERNEL - 1) :].t())


@pytest.mark.parametrize("length", LENGTHS)
def test_initial_state_matches_transformers_update(length: int) -> None:
    x, weight, state = _inputs(length, seed=100 + length)
    expected_out, expected_state = _hf_with_state(x, weight, state[0].clone())
    out = causal_conv1d(x, weight, state, torch.tensor([0]), (length,))
    torch.testing.assert_close(out, expected_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state[0], expected_state)


def test_varlen_batch_uses_each_requests_slot() -> None:
    lengths = (5, 1, 70, 2)
    slots = (3, 0, 4, 1)
    x, weight, state = _inputs(sum(lengths), seed=7, num_slots=5)
    initial = state.clone()
    out = causal_conv1d(x, weight, state, torch.tensor(slots), lengths)
    start = 0
    for slot, length in zip(slots, lengths):
        expected_out, expected_state = _hf_with_state(x[start : start + length], weight, initial[slot])
        torch.testing.assert_close(out[start : start + length], expected_out, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(state[slot], expected_state)
        start += length
    torch.testing.assert_close(state[2], initial[2])  # slot 2 belongs to nobody in this batch


def test_chained_chunks_shorter_than_kernel_equal_one_pass() -> None:
    x, weight, state = _inputs(40, seed=11)
    whole_state = state.clone()
    whole = causal_conv1d(x, weight, whole_state, torch.tensor([0]), (40,))
    pieces = []
    start = 0
    for length in (1, 2, 1, 7, 1, 1, 27):
        chunk = x[start : start + length]
        if length == 1:
            pieces.append(causal_conv1d_update(chunk, weight, state, torch.tensor([0])))
        else:
            pieces.append(causal_conv1d(chunk, weight, state, torch.tensor([0]), (length,)))
        start += length
    assert start == 40
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state, whole_state)


def test_decode_update_matches_general_form() -> None:
    x, weight, state = _inputs(3, seed=5, num_slots=6)
    slots = torch.tensor([4, 1, 5])
    general_state = state.clone()
    general = causal_conv1d(x, weight, general_state, slots, (1, 1, 1))
    decoded = causal_conv1d_update(x, weight, state, slots)
    torch.testing.assert_close(decoded, general)
    torch.testing.assert_close(state, general_state)


def test_bf16_state_and_output_dtype() -> None:
    x, weight, state = _inputs(9, seed=3)
    out = causal_conv1d(x.bfloat16(), weight.bfloat16(), state.bfloat16(), torch.tensor([0]), (9,))
    upcast = [t.bfloat16().float() for t in (x, weight, state)]
    reference = causal_conv1d(*upcast, torch.tensor([0]), (9,))
    assert out.dtype == torch.bfloat16
    # fp32 accumulation, one rounding at the end: within bf16 resolution of the fp32 result.
    torch.testing.assert_close(out.float(), reference, atol=1e-2, rtol=1e-2)
