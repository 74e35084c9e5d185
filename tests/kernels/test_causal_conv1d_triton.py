"""Our Triton causal conv1d kernels (varlen prefill, decode update) under Triton's CPU interpreter vs ref.py.

The compiled kernels at the real channel counts are tested in tests/gpu/test_causal_conv1d.py.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.causal_conv1d import ref
from tests.kernels.interpreter import cpu_interpreter, interpreted  # noqa: F401 (autouse fixture)

fast = interpreted("ninfer.kernels.causal_conv1d.triton")


CHANNELS = 200  # not a multiple of the 256-channel prefill block


def _inputs(num_tokens: int, kernel: int, num_slots: int, seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, CHANNELS, generator=gen).to(dtype)
    weight = (torch.randn(CHANNELS, kernel, generator=gen) * 0.5).to(dtype)
    state = torch.randn(num_slots, CHANNELS, kernel - 1, generator=gen).to(dtype)
    return x, weight, state


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    # fp32: summation order only. bf16: both round one fp32 value, at most one ulp apart.
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [4, 3])
def test_varlen_prefill_matches_reference(dtype: torch.dtype, kernel: int) -> None:
    # Lengths over several 16-token blocks and below the state width; an empty request; slots out of order.
    lengths = (5, 1, 33, 2, 0, 16)
    slots = [3, 0, 6, 1, 2, 5]
    x, weight, state = _inputs(sum(lengths), kernel, num_slots=7, seed=kernel, dtype=dtype)
    initial = state.clone()
    expected_state = state.clone()
    out = fast.causal_conv1d(x, weight, state, torch.tensor(slots), lengths)
    expected = ref.causal_conv1d(x, weight, expected_state, torch.tensor(slots), lengths)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **_tolerance(dtype))
    # The state is the last inputs, copied: exact.
    assert torch.equal(state, expected_state)
    assert torch.equal(state[4], initial[4])  # nobody's slot
    assert torch.equal(state[2], initial[2])  # the empty request's slot


@pytest.mark.parametrize("split", [(60, 60, 80), (200,), (1, 199), (120, 77, 3)])
def test_split_outputs_are_contiguous_parts(split: tuple[int, ...]) -> None:
    """The GDN's q, k, v written straight into their own contiguous matrices: the same values
    as the unsplit output's column blocks, the same state update."""
    lengths, slots = (5, 33, 2), torch.tensor([3, 0, 6])
    x, weight, state = _inputs(sum(lengths), 4, num_slots=7, seed=9)
    split_state, expected_state = state.clone(), state.clone()
    whole = fast.causal_conv1d(x, weight, state, slots, lengths)
    parts = fast.causal_conv1d(x, weight, split_state, slots, lengths, split)
    expected = ref.causal_conv1d(x, weight, expected_state, slots, lengths, split)
    assert len(parts) == len(split)
    for part, ref_part, block, width in zip(parts, expected, whole.split(list(split), dim=-1), split):
        assert part.shape == (sum(lengths), width) and part.is_contiguous()
        assert torch.equal(part, block)
        torch.testing.assert_close(part, ref_part, **_tolerance(torch.float32))
    assert torch.equal(split_state, state) and torch.equal(split_state, expected_state)


def test_split_must_cover_the_channels() -> None:
    x, weight, state = _inputs(4, 4, num_slots=2, seed=10)
    for bad in ((100, 99), (50, 50, 50, 50), (200, 0)):
        with pytest.raises(ValueError):
            fast.causal_conv1d(x, weight, state, torch.tensor([0]), (4,), bad)
        with pytest.raises(ValueError):
            ref.causal_conv1d(x, weight, state, torch.tensor([0]), (4,), bad)


def test_chunks_shorter_than_the_state_chain_exactly() -> None:
    x, weight, state = _inputs(9, 4, num_slots=2, seed=11)
    whole_state = state.clone()
    whole = ref.causal_conv1d(x, weight, whole_state, torch.tensor([1]), (9,))
    pieces, start = [], 0
    for length in (1, 2, 1, 5):
        chunk = x[start : start + length]
        if length == 1:
            pieces.append(fast.causal_conv1d_update(chunk, weight, state, torch.tensor([1])))
        else:
            pieces.append(fast.causal_conv1d(chunk, weight, state, torch.tensor([1]), (length,)))
        start += length
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-5)
    assert torch.equal(state, whole_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_update_matches_reference(dtype: torch.dtype) -> None:
    x, weight, state = _inputs(3, 4, num_slots=6, seed=5, dtype=dtype)
    slots = torch.tensor([4, 1, 5])
    initial = state.clone()
    expected_state = state.clone()
    out = fast.causal_conv1d_update(x, weight, state, slots)
    expected = ref.causal_conv1d_update(x, weight, expected_state, slots)
    torch.testing.assert_close(out, expected, **_tolerance(dtype))
    assert torch.equal(state, expected_state)
    for slot in (0, 2, 3):
        assert torch.equal(state[slot], initial[slot])


def test_verify_rows_leave_the_state_unchanged() -> None:
    """update_state=False (speculative verification): the same outputs, no slot written."""
    lengths, slots = (4, 4, 4), torch.tensor([3, 0, 6])
    x, weight, state = _inputs(sum(lengths), 4, num_slots=7, seed=11)
    initial = state.clone()
    out = fast.causal_conv1d(x, weight, state, slots, lengths, (60, 60, 80), update_state=False)
    expected = ref.causal_conv1d(x, weight, initial.clone(), slots, lengths, (60, 60, 80))
    for part, want in zip(out, expected):
        torch.testing.assert_close(part, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(state, initial)


def test_padded_varlen_matches_reference() -> None:
    """A step padded to a captured graph's shape: offsets read from the device that start past row
    0 (a rule's second pass), empty requests (padding, on the scratch slot), rows of no request,
    and a grid sized by the bound alone; the split parts as the model reads them."""
    starts = torch.tensor([7, 7, 12, 45, 45, 45], dtype=torch.int32)  # rows 0..6 and 45..49 belong to none
    slots = torch.tensor([3, 0, 6, 4, 4])  # slot 4: the empty requests' scratch
    x, weight, state = _inputs(50, 4, num_slots=7, seed=11)
    expected_state, direct_state = state.clone(), state.clone()
    split = (60, 60, 80)
    parts = fast.causal_conv1d_padded(x, weight, state, slots, starts, 64, split)
    expected = ref.causal_conv1d_padded(x, weight, expected_state, slots, starts, 64, split)
    for got, want in zip(parts, expected, strict=True):
        torch.testing.assert_close(got[7:45], want[7:45], **_tolerance(torch.float32))
    assert torch.equal(state, expected_state)
    # The same as the two non-empty requests alone: only their slots (0 and 6) change.
    direct = ref.causal_conv1d(x[7:45], weight, direct_state, torch.tensor([0, 6]), (5, 33))
    torch.testing.assert_close(torch.cat(parts, dim=-1)[7:45], direct, **_tolerance(torch.float32))
    assert torch.equal(state, direct_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [(4, 4, 4), (3, 1, 18)], ids=["verify", "varlen"])
def test_verify_rows_write_the_scratch_directly(dtype: torch.dtype, lengths: tuple[int, ...]) -> None:
    """out and inputs_out (a verify round's VerifyScratch rows of one layer): x is a column slice of
    a packed projection, as the layer's q|k|v; the output lands in out, x in inputs_out, exactly
    what the copies around the plain call produced; no slot, other layer or later row is written."""
    slots = torch.tensor([3, 0, 6])
    num_rows = sum(lengths)
    gen = torch.Generator().manual_seed(12)
    packed = torch.randn(num_rows, CHANNELS + 24, generator=gen).to(dtype)
    x = packed[:, 8 : 8 + CHANNELS]
    _, weight, state = _inputs(num_rows, 4, num_slots=7, seed=13, dtype=dtype)
    initial = state.clone()
    mixed, conv_inputs = (torch.full((2, num_rows + 5, CHANNELS), 7.0, dtype=dtype) for _ in range(2))
    out = fast.causal_conv1d(
        x, weight, state, slots, lengths, update_state=False, out=mixed[1, :num_rows],
        inputs_out=conv_inputs[1, :num_rows],
    )  # fmt: skip
    ref_mixed, ref_inputs = mixed.clone().fill_(7.0), conv_inputs.clone().fill_(7.0)
    ref_state = initial.clone()
    expected = ref.causal_conv1d(
        x, weight, ref_state, slots, lengths, update_state=False, out=ref_mixed[1, :num_rows],
        inputs_out=ref_inputs[1, :num_rows],
    )  # fmt: skip
    plain = ref.causal_conv1d(x, weight, initial.clone(), slots, lengths, update_state=False)
    assert out.data_ptr() == mixed[1].data_ptr() and expected.data_ptr() == ref_mixed[1].data_ptr()
    torch.testing.assert_close(mixed[1, :num_rows], plain, **_tolerance(dtype))
    assert torch.equal(ref_mixed[1, :num_rows], plain)  # the reference's out is its plain result
    assert torch.equal(conv_inputs[1, :num_rows], x) and torch.equal(ref_inputs, conv_inputs)
    for written in (mixed, conv_inputs):
        assert (written[0] == 7.0).all() and (written[1, num_rows:] == 7.0).all()
    assert torch.equal(state, initial) and torch.equal(ref_state, initial)


def test_scratch_outputs_are_checked() -> None:
    x, weight, state = _inputs(6, 4, num_slots=2, seed=14)
    slots = torch.tensor([0, 1])
    bad = [
        {"out": torch.empty(6, CHANNELS), "split": (100, 100)},  # out takes the whole result
        {"out": torch.empty(6, CHANNELS + 8)[:, :CHANNELS]},  # not contiguous
        {"out": torch.empty(6, CHANNELS, dtype=torch.bfloat16)},  # not x's dtype
        {"inputs_out": torch.empty(5, CHANNELS)},  # not x's shape
        {"inputs_out": torch.empty(CHANNELS, 6).t()},  # channels not contiguous
        {"inputs_out": torch.empty(6, CHANNELS), "lengths": (2, 3)},  # rows of no request
    ]
    for case in bad:
        lengths, split = case.pop("lengths", (2, 4)), case.pop("split", None)
        for impl in (fast, ref):
            with pytest.raises(ValueError):
                impl.causal_conv1d(x, weight, state, slots, lengths, split, update_state=False, **case)
