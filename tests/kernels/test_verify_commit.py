"""Committing accepted speculative verification rows: commit_gated_delta_rule and commit_conv_state.

The references against the existing per-layer ops on the selected rows (what
GatedDeltaNet.commit_verified runs), then the Triton kernels under Triton's CPU interpreter
against the references. The compiled kernels at the real shapes, and their capture in a CUDA
graph, are tested in tests/gpu/test_verify_commit.py.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.causal_conv1d import causal_conv1d, commit_conv_state
from ninfer.kernels.causal_conv1d import ref as conv_ref
from ninfer.kernels.gated_delta_rule import commit_gated_delta_rule, recurrent_gated_delta_rule_with_gates
from ninfer.kernels.gated_delta_rule import ref as gdn_ref

try:  # the interpreter tests need triton and no GPU; the reference tests run everywhere
    from tests.kernels.interpreter import cpu_interpreter, interpreted  # noqa: F401 (autouse fixture)
except pytest.skip.Exception:
    interpreted = None

needs_interpreter = pytest.mark.skipif(interpreted is None, reason="needs triton and no GPU (interpreter tests)")

NUM_LAYERS, NUM_K_HEADS, K_DIM = 2, 2, 16
ROWS_PER_REQUEST = 4  # K + 1: the last committed token and 3 drafts
NUM_SLOTS = 7
SLOTS = [5, 0, 3, 2]  # out of order, not 0..B-1
CHANNELS, CONV_KERNEL = 200, 4  # 200: not a multiple of the 256-channel block
# Accepted rows per request: none, one, all, and mixed (one shorter than the conv state).
COUNTS = {"none": (0, 0, 0, 0), "one": (1, 1, 1, 1), "all": (4, 4, 4, 4), "mixed": (0, 4, 1, 2)}
ATOL, RTOL = 1e-5, 1e-5  # fp32: the same terms summed in another order


def _row_starts(num_requests: int) -> torch.Tensor:
    return torch.arange(num_requests) * ROWS_PER_REQUEST


def _selected_rows(starts: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), counts)] + [torch.zeros(0, dtype=torch.long)])


def _gdn_inputs(num_v_heads: int, v_dim: int, seed: int, dtype: torch.dtype = torch.float32):
    """Per-layer scratch rows as the verification forward leaves them, per-layer gate params, states."""
    gen = torch.Generator().manual_seed(seed)
    num_rows = ROWS_PER_REQUEST * len(SLOTS)
    conv_dim = 2 * NUM_K_HEADS * K_DIM + num_v_heads * v_dim
    mixed = torch.randn(NUM_LAYERS, num_rows, conv_dim, generator=gen).to(dtype)
    gates = (torch.randn(NUM_LAYERS, num_rows, 2 * num_v_heads, generator=gen) * 3).to(dtype)
    A_log = torch.rand(NUM_LAYERS, num_v_heads, generator=gen).log1p().to(dtype)
    dt_bias = torch.randn(NUM_LAYERS, num_v_heads, generator=gen).to(dtype)
    state = torch.randn(NUM_LAYERS, NUM_SLOTS, num_v_heads, K_DIM, v_dim, generator=gen) * 0.5
    return mixed, gates, A_log, dt_bias, state


def _gdn_per_layer(mixed, gates, A_log, dt_bias, state, slots, starts, counts) -> None:
    """The existing path: per layer, the recurrent rule over the index_select-ed rows, state written."""
    num_v_heads, v_dim = state.shape[2], state.shape[4]
    rows = _selected_rows(starts, counts)
    key_dim = NUM_K_HEADS * K_DIM
    for layer in range(state.shape[0]):
        q, k, v = mixed[layer].index_select(0, rows).split([key_dim, key_dim, num_v_heads * v_dim], dim=-1)
        a, b = gates[layer].index_select(0, rows).split(num_v_heads, dim=-1)
        recurrent_gated_delta_rule_with_gates(
            q.reshape(-1, NUM_K_HEADS, K_DIM),
            k.reshape(-1, NUM_K_HEADS, K_DIM),
            v.reshape(-1, num_v_heads, v_dim),
            a,
            b,
            A_log[layer],
            dt_bias[layer],
            state[layer],
            slots,
            counts,
        )


def _assert_untouched(state: torch.Tensor, initial: torch.Tensor, counts: tuple[int, ...]) -> None:
    kept = {s for s, n in zip(SLOTS, counts) if n > 0}
    for slot in set(range(NUM_SLOTS)) - kept:
        assert torch.equal(state[:, slot], initial[:, slot]), f"slot {slot} has no accepted rows but changed"


@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("num_v_heads, v_dim", [(6, 12), (4, 16)])
def test_gdn_reference_equals_the_per_layer_recurrent_rule(counts, num_v_heads: int, v_dim: int) -> None:
    mixed, gates, A_log, dt_bias, state = _gdn_inputs(num_v_heads, v_dim, seed=sum(counts) + v_dim)
    slots, starts = torch.tensor(SLOTS), _row_starts(len(SLOTS))
    initial, expected = state.clone(), state.clone()
    commit_gated_delta_rule(
        mixed, gates, A_log, dt_bias, state, slots, starts, torch.tensor(counts), NUM_K_HEADS, ROWS_PER_REQUEST
    )
    _gdn_per_layer(mixed, gates, A_log, dt_bias, expected, slots, starts, counts)
    torch.testing.assert_close(state, expected, atol=ATOL, rtol=RTOL)
    _assert_untouched(state, initial, counts)
    if any(counts):
        assert not torch.equal(state, initial)


def test_gdn_reference_rejects_counts_past_the_bound() -> None:
    mixed, gates, A_log, dt_bias, state = _gdn_inputs(4, 16, seed=0)
    with pytest.raises(ValueError):
        gdn_ref.commit_gated_delta_rule(
            mixed, gates, A_log, dt_bias, state, torch.tensor(SLOTS), _row_starts(4), torch.tensor([0, 4, 1, 4]),
            NUM_K_HEADS, 3,
        )  # fmt: skip


def _conv_inputs(seed: int, dtype: torch.dtype = torch.float32, kernel: int = CONV_KERNEL):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(NUM_LAYERS, ROWS_PER_REQUEST * len(SLOTS), CHANNELS, generator=gen).to(dtype)
    weight = torch.randn(CHANNELS, kernel, generator=gen).to(dtype)  # the per-layer op needs one
    state = torch.randn(NUM_LAYERS, NUM_SLOTS, CHANNELS, kernel - 1, generator=gen).to(dtype)
    return x, weight, state


@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [4, 3])
def test_conv_reference_equals_the_per_layer_conv(counts, dtype: torch.dtype, kernel: int) -> None:
    x, weight, state = _conv_inputs(seed=sum(counts), dtype=dtype, kernel=kernel)
    slots, starts = torch.tensor(SLOTS), _row_starts(len(SLOTS))
    initial, expected = state.clone(), state.clone()
    commit_conv_state(x, state, slots, starts, torch.tensor(counts), ROWS_PER_REQUEST)
    rows = _selected_rows(starts, counts)
    for layer in range(NUM_LAYERS):
        causal_conv1d(x[layer].index_select(0, rows), weight, expected[layer], slots, counts)
    assert torch.equal(state, expected)  # a copy of inputs: exact
    _assert_untouched(state, initial, counts)


def test_conv_reference_rejects_counts_past_the_bound() -> None:
    x, _, state = _conv_inputs(seed=0)
    initial = state.clone()
    with pytest.raises(ValueError):
        conv_ref.commit_conv_state(x, state, torch.tensor(SLOTS), _row_starts(4), torch.tensor([1, 4, 1, 5]), 4)
    assert torch.equal(state, initial)  # checked before any slot is written


# Triton under the CPU interpreter vs the references.


@pytest.fixture
def fast_gdn():
    if interpreted is None:
        pytest.skip("needs triton and no GPU (interpreter tests)")
    return interpreted("ninfer.kernels.gated_delta_rule.triton")


@pytest.fixture
def fast_conv():
    if interpreted is None:
        pytest.skip("needs triton and no GPU (interpreter tests)")
    return interpreted("ninfer.kernels.causal_conv1d.triton")


@needs_interpreter
@pytest.mark.parametrize("counts", [COUNTS["mixed"], COUNTS["all"], COUNTS["none"]], ids=["mixed", "all", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_kernel_matches_reference(fast_gdn, counts, dtype: torch.dtype) -> None:
    # Hv / Hk = 3; dv 12 with BLOCK_V 8: the second strip is half masked.
    mixed, gates, A_log, dt_bias, state = _gdn_inputs(6, 12, seed=7, dtype=dtype)
    slots, starts = torch.tensor(SLOTS), _row_starts(len(SLOTS))
    initial, expected = state.clone(), state.clone()
    args = (slots, starts, torch.tensor(counts), NUM_K_HEADS, ROWS_PER_REQUEST)
    fast_gdn.commit_gated_delta_rule(mixed, gates, A_log, dt_bias, state, *args, block_v=8)
    gdn_ref.commit_gated_delta_rule(mixed, gates, A_log, dt_bias, expected, *args)
    # bf16 inputs too: both widen the same bf16 values and compute in fp32.
    torch.testing.assert_close(state, expected, atol=ATOL, rtol=RTOL)
    _assert_untouched(state, initial, counts)


@needs_interpreter
def test_gdn_kernel_reads_strided_rows_and_a_larger_bound(fast_gdn) -> None:
    """Scratch views with a row stride past their width, starts with gaps, and a trip count past
    every request's count: the extra steps must leave the state alone (softplus(dt_bias) != 0)."""
    mixed, gates, A_log, dt_bias, state = _gdn_inputs(4, 16, seed=8)
    mixed = torch.cat((mixed, torch.randn_like(mixed[..., :5])), dim=-1)[..., :-5]
    gates = torch.cat((gates, torch.randn_like(gates)), dim=-1)[..., : gates.shape[-1]]
    assert mixed.stride(1) != mixed.shape[-1] and gates.stride(1) != gates.shape[-1]
    slots, starts, counts = torch.tensor(SLOTS), torch.tensor([9, 0, 4, 13]), torch.tensor([3, 2, 0, 1])
    expected = state.clone()
    fast_gdn.commit_gated_delta_rule(mixed, gates, A_log, dt_bias, state, slots, starts, counts, NUM_K_HEADS, 6)
    gdn_ref.commit_gated_delta_rule(mixed, gates, A_log, dt_bias, expected, slots, starts, counts, NUM_K_HEADS, 6)
    torch.testing.assert_close(state, expected, atol=ATOL, rtol=RTOL)


@needs_interpreter
@pytest.mark.parametrize("counts", [COUNTS["mixed"], COUNTS["all"], (1, 0, 3, 2)], ids=["mixed", "all", "short"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [4, 3])
def test_conv_kernel_matches_reference(fast_conv, counts, dtype: torch.dtype, kernel: int) -> None:
    x, _, state = _conv_inputs(seed=kernel, dtype=dtype, kernel=kernel)
    slots, starts = torch.tensor(SLOTS), _row_starts(len(SLOTS))
    initial, expected = state.clone(), state.clone()
    fast_conv.commit_conv_state(x, state, slots, starts, torch.tensor(counts), ROWS_PER_REQUEST)
    conv_ref.commit_conv_state(x, expected, slots, starts, torch.tensor(counts), ROWS_PER_REQUEST)
    assert torch.equal(state, expected)
    _assert_untouched(state, initial, counts)
