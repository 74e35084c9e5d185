"""Our Triton recurrent gated-delta-rule kernel under Triton's CPU interpreter vs ref.py.

Small shapes (the interpreter runs every program in Python). The compiled kernel at the
real shapes is tested in tests/gpu/test_gated_delta_rule.py.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.gated_delta_rule import ref
from tests.kernels.interpreter import cpu_interpreter, interpreted  # noqa: F401 (autouse fixture)

fast = interpreted("ninfer.kernels.gated_delta_rule.triton")


# fp32 everywhere; the kernel and the reference sum the same terms in a different order.
ATOL, RTOL = 1e-5, 1e-5


def _inputs(num_tokens: int, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, num_slots: int, seed: int):
    """q, k, v as strided column slices of one conv output, as the layer produces them."""
    gen = torch.Generator().manual_seed(seed)
    key_dim, value_dim = num_k_heads * k_dim, num_v_heads * v_dim
    conv = torch.randn(num_tokens, 2 * key_dim + value_dim, generator=gen)
    q = conv[:, :key_dim].reshape(num_tokens, num_k_heads, k_dim)
    k = conv[:, key_dim : 2 * key_dim].reshape(num_tokens, num_k_heads, k_dim)
    v = conv[:, 2 * key_dim :].reshape(num_tokens, num_v_heads, v_dim)
    g = -(torch.rand(num_tokens, num_v_heads, generator=gen) ** 3)
    beta = torch.sigmoid(torch.randn(num_tokens, num_v_heads, generator=gen))
    state = torch.randn(num_slots, num_v_heads, k_dim, v_dim, generator=gen) * 0.5
    return q, k, v, g, beta, state


def _check(lengths, slots, shape=(2, 6, 16, 12), num_slots=6, seed=0, block_v=8):
    q, k, v, g, beta, state = _inputs(sum(lengths), *shape, num_slots=num_slots, seed=seed)
    initial = state.clone()
    expected_state = state.clone()
    slot_ids = torch.tensor(slots)
    out = fast.recurrent_gated_delta_rule(q, k, v, g, beta, state, slot_ids, lengths, block_v=block_v)
    expected = ref.recurrent_gated_delta_rule(q, k, v, g, beta, expected_state, slot_ids, lengths)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(state, expected_state, atol=ATOL, rtol=RTOL)
    for slot in set(range(num_slots)) - set(slots):
        assert torch.equal(state[slot], initial[slot]), f"slot {slot} belongs to nobody but changed"
    return state, initial


def test_decode_round_updates_noncontiguous_slots_in_place() -> None:
    # v head dim 12 with BLOCK_V 8: the second strip is half masked; Hv/Hk = 3.
    state, initial = _check((1, 1, 1), [4, 0, 2])
    assert not torch.equal(state[4], initial[4])


def test_equal_length_verify_rows() -> None:
    _check((3, 3), [1, 5], seed=1)


def test_varlen_with_an_empty_request() -> None:
    # The empty request's slot must stay as it was (the reference writes it back unchanged).
    state, initial = _check((2, 0, 5, 1), [3, 1, 0, 5], seed=2)
    assert torch.equal(state[1], initial[1])


def test_head_dims_that_are_not_powers_of_two() -> None:
    _check((1, 2), [2, 0], shape=(1, 2, 12, 20), seed=3, block_v=16)


def test_bf16_inputs_keep_fp32_state() -> None:
    q, k, v, g, beta, state = _inputs(2, 2, 4, 16, 16, num_slots=3, seed=4)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    expected_state = state.clone()
    slots = torch.tensor([2, 0])
    out = fast.recurrent_gated_delta_rule(q, k, v, g, beta, state, slots, (1, 1))
    expected = ref.recurrent_gated_delta_rule(q, k, v, g, beta, expected_state, slots, (1, 1))
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    # Both compute in fp32 from the same bf16 inputs; the outputs round once to bf16.
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(state, expected_state, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("lengths", [(1, 1, 1), (3, 1, 4)], ids=["decode", "varlen"])
def test_gates_computed_in_the_kernel_match_reference(lengths: tuple[int, ...]) -> None:
    """The raw-projection form: a, b strided slices of one packed row; in varlen rows the
    steps past a request's end must leave its state alone although softplus(0 + dt_bias) != 0."""
    q, k, v, _, _, state = _inputs(sum(lengths), 2, 6, 16, 12, num_slots=6, seed=5)
    gen = torch.Generator().manual_seed(6)
    packed = torch.randn(sum(lengths), 20, generator=gen) * 3
    a, b = packed[:, 2:8], packed[:, 11:17]
    A_log = torch.rand(6, generator=gen).log1p()
    dt_bias = torch.randn(6, generator=gen)
    expected_state = state.clone()
    slot_ids = torch.tensor([4, 0, 2])
    out = fast.recurrent_gated_delta_rule_with_gates(q, k, v, a, b, A_log, dt_bias, state, slot_ids, lengths)
    expected = ref.recurrent_gated_delta_rule_with_gates(
        q, k, v, a, b, A_log, dt_bias, expected_state, slot_ids, lengths
    )
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(state, expected_state, atol=ATOL, rtol=RTOL)


def test_varlen_metadata_for_fla_is_built_once_per_lengths() -> None:
    """fla's varlen inputs (cu_seqlens, chunk_indices = [sequence, chunk] per 64 tokens and
    chunk_offsets = chunks before each sequence, as its prepare_chunk_indices and
    prepare_chunk_offsets build them: tests/gpu checks they agree) are the same tensors for every
    GDN layer of a step, so fla neither copies nor syncs per layer."""
    from ninfer.kernels.gated_delta_rule.triton import _varlen_metadata

    cu_seqlens, chunk_indices, chunk_offsets = _varlen_metadata((5, 64, 130), torch.device("cpu"))
    assert cu_seqlens.tolist() == [0, 5, 69, 199]
    assert chunk_indices.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [2, 2]]
    assert chunk_offsets.tolist() == [0, 1, 2, 5]
    assert _varlen_metadata((5, 64, 130), torch.device("cpu"))[1] is chunk_indices
    assert _varlen_metadata((5, 64, 130), torch.device("cpu"))[0] is cu_seqlens
    assert _varlen_metadata((5, 64, 131), torch.device("cpu"))[1] is not chunk_indices


def test_verify_rows_leave_the_state_unchanged() -> None:
    """update_state=False (speculative verification): the same outputs, no slot written."""
    lengths, slots = (4, 4), [1, 5]
    q, k, v, g, beta, state = _inputs(sum(lengths), 2, 6, 16, 12, num_slots=6, seed=5)
    initial = state.clone()
    slot_ids = torch.tensor(slots)
    out = fast.recurrent_gated_delta_rule(q, k, v, g, beta, state, slot_ids, lengths, False, block_v=8)
    expected = ref.recurrent_gated_delta_rule(q, k, v, g, beta, initial.clone(), slot_ids, lengths)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    assert torch.equal(state, initial)


def test_state_rows_of_a_padded_step_copy_only_live_requests() -> None:
    """The padded rule's state copies: rows of requests with tokens gathered from their slots (and
    written back), empty requests (the scratch slot, shared) neither read nor written."""
    gen = torch.Generator().manual_seed(3)
    state = torch.randn(7, 3, 4, 5, generator=gen)
    slots = torch.tensor([4, 6, 1, 6, 6])  # slot 6: the scratch slot of the empty requests
    starts = torch.tensor([0, 3, 3, 4, 4, 4])  # requests 1, 3 and 4 are empty
    gathered = fast.gather_state_rows(state, slots, starts)
    assert torch.equal(gathered[[0, 2]], state[[4, 1]])
    torch.testing.assert_close(gathered[[0, 2]], ref.gather_state_rows(state, slots, starts)[[0, 2]])
    rows = torch.randn(5, 3, 4, 5, generator=gen)
    expected = state.clone()
    ref.scatter_state_rows(expected, slots, starts, rows)
    fast.scatter_state_rows(state, slots, starts, rows)
    assert torch.equal(state, expected)
    assert torch.equal(state[4], rows[0]) and torch.equal(state[1], rows[2])
    assert not torch.equal(state[6], rows[1]) and not torch.equal(state[6], rows[4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [(4, 4), (3, 1, 4)], ids=["verify", "varlen"])
def test_verify_rows_store_the_raw_gates(dtype: torch.dtype, lengths: tuple[int, ...]) -> None:
    """gates_out (a verify round's VerifyScratch gates of one layer): a | b as loaded, exactly what
    the copies around the plain call produced, with the same outputs and no slot written. v head
    dim 40 spans two column strips of the CPU's 32, of which only the first stores."""
    num_rows, num_v_heads = sum(lengths), 6
    q, k, v, _, _, state = _inputs(num_rows, 2, num_v_heads, 16, 40, num_slots=6, seed=7)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    gen = torch.Generator().manual_seed(8)
    packed = (torch.randn(num_rows, 2 * num_v_heads + 8, generator=gen) * 3).to(dtype)
    b, a = packed[:, 2 : 2 + num_v_heads], packed[:, 2 + num_v_heads : 2 + 2 * num_v_heads]  # the layer's order
    A_log = torch.rand(num_v_heads, generator=gen).log1p()
    dt_bias = torch.randn(num_v_heads, generator=gen)
    slot_ids = torch.tensor([4, 0, 2][: len(lengths)])
    initial = state.clone()
    gates = torch.full((2, num_rows + 3, 2 * num_v_heads), 7.0, dtype=dtype)
    ref_gates = gates.clone()
    args = (A_log, dt_bias, state, slot_ids, lengths, False)
    out = fast.recurrent_gated_delta_rule_with_gates(q, k, v, a, b, *args, gates_out=gates[1, :num_rows])
    ref_args = (A_log, dt_bias, initial.clone(), slot_ids, lengths, False)
    expected = ref.recurrent_gated_delta_rule_with_gates(q, k, v, a, b, *ref_args, gates_out=ref_gates[1, :num_rows])
    plain = ref.recurrent_gated_delta_rule_with_gates(q, k, v, a, b, *ref_args)
    assert torch.equal(expected, plain)
    tolerance = {"atol": ATOL, "rtol": RTOL} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(out.float(), plain.float(), **tolerance)
    assert torch.equal(gates[1, :num_rows], torch.cat((a, b), dim=-1)) and torch.equal(gates, ref_gates)
    assert (gates[0] == 7.0).all() and (gates[1, num_rows:] == 7.0).all()
    assert torch.equal(state, initial)


def test_gates_out_is_checked() -> None:
    q, k, v, _, _, state = _inputs(4, 2, 6, 16, 12, num_slots=6, seed=9)
    a, b, A_log, dt_bias = torch.randn(4, 6), torch.randn(4, 6), torch.zeros(6), torch.ones(6)
    bad = [
        (torch.empty(4, 11), (2, 2)),  # not 2 * Hv wide
        (torch.empty(12, 4).t(), (2, 2)),  # heads not contiguous
        (torch.empty(4, 12, dtype=torch.bfloat16), (2, 2)),  # not a's dtype
        (torch.empty(4, 12), (2, 1)),  # rows of no request
    ]
    for gates_out, lengths in bad:
        for impl in (fast, ref):
            with pytest.raises(ValueError):
                impl.recurrent_gated_delta_rule_with_gates(
                    q, k, v, a, b, A_log, dt_bias, state, torch.tensor([0, 1]), lengths, False, gates_out=gates_out
                )
