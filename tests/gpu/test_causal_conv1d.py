"""Triton causal conv1d on the GPU vs ref.py at the real conv widths; CUDA-graph decode update.

Both compute in fp32 from the same bf16 inputs and round once to bf16, so outputs agree to
one bf16 rounding; the conv state is a copy of inputs and must match exactly.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.causal_conv1d import causal_conv1d, causal_conv1d_update, ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CONV_DIMS = {"27B": 10240, "35B-A3B": 8192}
KERNEL = 4
NUM_SLOTS = 9
BF16 = {"atol": 1e-2, "rtol": 1e-2}


def _inputs(num_tokens: int, conv_dim: int, seed: int):
    gen = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(num_tokens, conv_dim, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(conv_dim, KERNEL, device="cuda", generator=gen) * 0.5).bfloat16()
    state = torch.randn(NUM_SLOTS, conv_dim, KERNEL - 1, device="cuda", generator=gen).bfloat16()
    return x, weight, state


@pytest.mark.parametrize("shape", list(CONV_DIMS))
@pytest.mark.parametrize(
    "lengths, slots",
    [
        ((1,), [3]),
        ((63,), [0]),
        ((64,), [8]),
        ((65,), [2]),
        ((1000,), [5]),
        ((65, 1, 1000, 2, 0, 63), [5, 0, 8, 2, 6, 3]),
    ],
)
def test_varlen_prefill_matches_reference(shape: str, lengths: tuple[int, ...], slots: list[int]) -> None:
    x, weight, state = _inputs(sum(lengths), CONV_DIMS[shape], seed=sum(lengths))
    initial = state.clone()
    expected_state = state.clone()
    out = causal_conv1d(x, weight, state, torch.tensor(slots, device="cuda"), lengths)
    expected = ref.causal_conv1d(x, weight, expected_state, torch.tensor(slots, device="cuda"), lengths)
    torch.testing.assert_close(out, expected, **BF16)
    assert torch.equal(state, expected_state)
    for slot in set(range(NUM_SLOTS)) - {s for s, n in zip(slots, lengths) if n > 0}:
        assert torch.equal(state[slot], initial[slot])


@pytest.mark.parametrize("shape", list(CONV_DIMS))
@pytest.mark.parametrize("lengths", [(4,), (4,) * 8, (2, 4, 17)], ids=["b1", "b8", "varlen"])
def test_verify_rows_write_the_scratch(shape: str, lengths: tuple[int, ...]) -> None:
    """Speculative verification rows (update_state=False) with out and inputs_out, one layer's rows
    of a [layers, rows, C] scratch: the output as the reference's, x (a column slice of the packed
    projection, as the layer's q|k|v) copied exactly; no slot, other layer or later row written."""
    conv_dim, num_rows = CONV_DIMS[shape], sum(lengths)
    slots = torch.tensor([8, 1, 4, 0, 7, 2, 5, 3][: len(lengths)], device="cuda")
    _, weight, state = _inputs(1, conv_dim, seed=num_rows)
    gen = torch.Generator("cuda").manual_seed(num_rows)
    packed = torch.randn(num_rows, conv_dim + 160, device="cuda", generator=gen).bfloat16()
    x = packed[:, :conv_dim]
    initial = state.clone()
    mixed, conv_inputs = (torch.full((3, num_rows + 4, conv_dim), 7.0, device="cuda").bfloat16() for _ in range(2))
    out = causal_conv1d(
        x, weight, state, slots, lengths, update_state=False, out=mixed[1, :num_rows],
        inputs_out=conv_inputs[1, :num_rows],
    )  # fmt: skip
    expected = ref.causal_conv1d(x, weight, initial.clone(), slots, lengths, update_state=False)
    assert out.data_ptr() == mixed[1].data_ptr()
    torch.testing.assert_close(mixed[1, :num_rows], expected, **BF16)
    assert torch.equal(conv_inputs[1, :num_rows], x)
    for written in (mixed, conv_inputs):
        assert (written[[0, 2]] == 7.0).all() and (written[1, num_rows:] == 7.0).all()
    assert torch.equal(state, initial)


@pytest.mark.parametrize("shape", list(CONV_DIMS))
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_update_matches_reference(shape: str, batch: int) -> None:
    x, weight, state = _inputs(batch, CONV_DIMS[shape], seed=batch)
    slots = torch.tensor([8, 1, 4, 0, 7, 2, 5, 3][:batch], device="cuda")
    expected_state = state.clone()
    out = causal_conv1d_update(x, weight, state, slots)
    expected = ref.causal_conv1d_update(x, weight, expected_state, slots)
    torch.testing.assert_close(out, expected, **BF16)
    assert torch.equal(state, expected_state)


def test_decode_update_replays_in_a_cuda_graph() -> None:
    conv_dim = CONV_DIMS["27B"]
    x, weight, state = _inputs(8, conv_dim, seed=1)
    slots = torch.tensor([8, 1, 4, 0, 7, 2, 5, 3], device="cuda")
    start = state.clone()
    causal_conv1d_update(x, weight, state, slots)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = causal_conv1d_update(x, weight, state, slots)
    inputs = [torch.randn(8, conv_dim, device="cuda").bfloat16() for _ in range(3)]
    state.copy_(start)
    eager = []
    for new in inputs:
        eager.append((causal_conv1d_update(new, weight, state, slots), state.clone()))
    state.copy_(start)
    for new, (out_e, state_e) in zip(inputs, eager):
        x.copy_(new)
        graph.replay()
        assert torch.equal(static_out, out_e)
        assert torch.equal(state, state_e)
