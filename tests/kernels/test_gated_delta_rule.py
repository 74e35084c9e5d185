"""Gated delta rule: chunked vs recurrent form vs transformers' torch references, varlen, chained chunks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from ninfer.kernels.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

NUM_K_HEADS, NUM_V_HEADS, K_DIM, V_DIM = 2, 4, 16, 8
LENGTHS = (1, 3, 63, 64, 65, 130)
# fp32 throughout; the two forms sum the same terms in a different order.
ATOL, RTOL = 2e-5, 1e-4


def _inputs(length: int, seed: int, num_slots: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Decays from almost none (long memory) to strong, so chunk boundaries carry real state.
    decay_rate = torch.empty(length, NUM_V_HEADS).uniform_(0.0, 1.0, generator=gen) ** 3
    return {
        "q": torch.randn(length, NUM_K_HEADS, K_DIM, generator=gen),
        "k": torch.randn(length, NUM_K_HEADS, K_DIM, generator=gen),
        "v": torch.randn(length, NUM_V_HEADS, V_DIM, generator=gen),
        "g": -decay_rate,
        "beta": torch.sigmoid(torch.randn(length, NUM_V_HEADS, generator=gen)),
        "state": torch.randn(num_slots, NUM_V_HEADS, K_DIM, V_DIM, generator=gen) * 0.5,
    }


def _hf(
    fn: Callable[..., tuple], inputs: dict[str, torch.Tensor], rows: slice, initial: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' functions take [B, T, H, d] with q/k already repeated to the v heads."""
    group = NUM_V_HEADS // NUM_K_HEADS
    q = inputs["q"][rows].repeat_interleave(group, dim=1)[None]
    k = inputs["k"][rows].repeat_interleave(group, dim=1)[None]
    out, final = fn(
        q,
        k,
        inputs["v"][rows][None],
        g=inputs["g"][rows][None],
        beta=inputs["beta"][rows][None],
        initial_state=initial[None].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], final[0]


def _run(
    form: Callable[..., torch.Tensor],
    inputs: dict[str, torch.Tensor],
    state: torch.Tensor,
    slots: list[int],
    lengths: tuple[int, ...],
    rows: slice | None = None,
) -> torch.Tensor:
    rows = rows or slice(None)
    args = (inputs["q"][rows], inputs["k"][rows], inputs["v"][rows], inputs["g"][rows], inputs["beta"][rows])
    return form(*args, state, torch.tensor(slots), lengths)


@pytest.mark.parametrize("length", LENGTHS)
def test_single_request_matches_transformers(length: int) -> None:
    inputs = _inputs(length, seed=length)
    initial = inputs["state"][0]
    hf_chunk_out, hf_chunk_state = _hf(torch_chunk_gated_delta_rule, inputs, slice(None), initial)
    hf_rec_out, hf_rec_state = _hf(torch_recurrent_gated_delta_rule, inputs, slice(None), initial)
    torch.testing.assert_close(hf_chunk_out, hf_rec_out, atol=ATOL, rtol=RTOL)  # the references agree

    for form in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        state = inputs["state"].clone()
        out = _run(form, inputs, state, [0], (length,))
        torch.testing.assert_close(out, hf_chunk_out, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(out, hf_rec_out, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(state[0], hf_rec_state, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(state[0], hf_chunk_state, atol=ATOL, rtol=RTOL)


def test_zero_state_is_a_fresh_sequence() -> None:
    inputs = _inputs(70, seed=1)
    state = torch.zeros_like(inputs["state"])
    out = _run(chunk_gated_delta_rule, inputs, state, [0], (70,))
    hf = torch_chunk_gated_delta_rule(
        inputs["q"].repeat_interleave(2, dim=1)[None],
        inputs["k"].repeat_interleave(2, dim=1)[None],
        inputs["v"][None],
        g=inputs["g"][None],
        beta=inputs["beta"][None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(out, hf[0][0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(state[0], hf[1][0], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("form", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_varlen_batch_with_initial_states(form: Callable[..., torch.Tensor]) -> None:
    lengths = (5, 64, 1, 70, 3)
    slots = [3, 0, 5, 1, 4]
    inputs = _inputs(sum(lengths), seed=21, num_slots=6)
    initial = inputs["state"].clone()
    state = inputs["state"].clone()
    out = _run(form, inputs, state, slots, lengths)
    start = 0
    for slot, length in zip(slots, lengths):
        rows = slice(start, start + length)
        expected_out, expected_state = _hf(torch_recurrent_gated_delta_rule, inputs, rows, initial[slot])
        torch.testing.assert_close(out[rows], expected_out, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(state[slot], expected_state, atol=ATOL, rtol=RTOL)
        start += length
    torch.testing.assert_close(state[2], initial[2])  # unused slot untouched


def test_decode_batch_matches_per_request() -> None:
    slots = [2, 0, 3]
    inputs = _inputs(3, seed=8, num_slots=4)
    batched_state = inputs["state"].clone()
    batched = _run(recurrent_gated_delta_rule, inputs, batched_state, slots, (1, 1, 1))
    chunked_state = inputs["state"].clone()
    chunked = _run(chunk_gated_delta_rule, inputs, chunked_state, slots, (1, 1, 1))
    torch.testing.assert_close(batched, chunked, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(batched_state, chunked_state, atol=ATOL, rtol=RTOL)
    for i, slot in enumerate(slots):
        rows = slice(i, i + 1)
        expected_out, expected_state = _hf(torch_recurrent_gated_delta_rule, inputs, rows, inputs["state"][slot])
        torch.testing.assert_close(batched[i : i + 1], expected_out, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(batched_state[slot], expected_state, atol=ATOL, rtol=RTOL)


def test_chained_chunks_leave_the_full_sequence_state() -> None:
    total = 130
    inputs = _inputs(total, seed=33)
    full_state = inputs["state"].clone()
    full = _run(chunk_gated_delta_rule, inputs, full_state, [0], (total,))
    state = inputs["state"].clone()
    pieces = []
    start = 0
    chunked, recurrent = chunk_gated_delta_rule, recurrent_gated_delta_rule
    for length, form in ((40, chunked), (1, recurrent), (1, recurrent), (64, chunked), (3, recurrent), (21, chunked)):
        rows = slice(start, start + length)
        pieces.append(_run(form, inputs, state, [0], (length,), rows))
        start += length
    assert start == total
    torch.testing.assert_close(torch.cat(pieces), full, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(state, full_state, atol=ATOL, rtol=RTOL)


def test_bf16_inputs_keep_fp32_state() -> None:
    inputs = _inputs(20, seed=4)
    state = inputs["state"].clone()
    low = {name: t.bfloat16() if name != "state" else t for name, t in inputs.items()}
    out = _run(chunk_gated_delta_rule, low, state, [0], (20,))
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    ref_state = inputs["state"].clone()
    upcast = {name: t.float() for name, t in low.items()}
    reference = _run(chunk_gated_delta_rule, upcast, ref_state, [0], (20,))
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state, ref_state, atol=1e-6, rtol=1e-6)


def test_verify_then_commit_equals_decoding_the_accepted_rows() -> None:
    """Speculative verification scores rows without writing the state (update_state=False);
    running the accepted prefix again with the state written leaves what plain decode would."""
    form = recurrent_gated_delta_rule
    inputs = _inputs(4, seed=12, num_slots=2)
    state = inputs["state"].clone()
    verify = form(*(inputs[n] for n in ("q", "k", "v", "g", "beta")), state, torch.tensor([1]), (4,), False)
    assert torch.equal(state, inputs["state"])
    decoded_state = inputs["state"].clone()
    decoded = [_run(form, inputs, decoded_state, [1], (1,), slice(t, t + 1)) for t in range(2)]
    torch.testing.assert_close(verify[:2], torch.cat(decoded), atol=ATOL, rtol=RTOL)
    _run(form, inputs, state, [1], (2,), slice(0, 2))  # the commit of two accepted rows
    torch.testing.assert_close(state, decoded_state, atol=ATOL, rtol=RTOL)
