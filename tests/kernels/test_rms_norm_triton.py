"""Our Triton RMSNorm kernels (plain, residual-add + norm, gated) under Triton's CPU interpreter vs ref.py.

The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even, so the fixture
below gives it the GPU's rounding: the bf16 results can then be held to the references'
exact cast order (almost all elements bitwise equal, the rest one ulp apart from fp32
summation order), which a loose tolerance could not check. The compiled kernels at the real
shapes are tested in tests/gpu/test_rms_norm.py.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.rms_norm import ref
from tests.kernels.interpreter import (  # noqa: F401 (fixtures)
    bf16_round_to_nearest_even,
    cpu_interpreter,
    interpreted,
)
from tests.ulp import assert_matches

pytestmark = pytest.mark.usefixtures("bf16_round_to_nearest_even")

fast = interpreted("ninfer.kernels.rms_norm.triton")

DIM = 200  # not a power of two: the 256-wide block is partly masked
EPS = 1e-6
def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _weight(zero_centered: bool, dtype: torch.dtype, seed: int, dim: int = DIM) -> torch.Tensor:
    # Checkpoint-like: Llama weights around 1, zero-centred ones around 0.
    return _randn(dim, seed=seed, scale=0.3).add(0.0 if zero_centered else 1.0).to(dtype)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_add_rms_norm_reference_is_the_add_then_the_norm(zero_centered: bool) -> None:
    x, residual = _randn(5, DIM, seed=1, dtype=torch.bfloat16), _randn(5, DIM, seed=2, dtype=torch.bfloat16)
    weight = _weight(zero_centered, torch.bfloat16, seed=3)
    normed, summed = ref.add_rms_norm(x, residual, weight, EPS, zero_centered)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, ref.rms_norm(x + residual, weight, EPS, zero_centered))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("shape", [(1, DIM), (7, DIM), (3, 5, DIM)])
def test_rms_norm_matches_reference(dtype: torch.dtype, zero_centered: bool, shape: tuple[int, ...]) -> None:
    x = _randn(*shape, seed=len(shape), dtype=dtype, scale=3.0)
    weight = _weight(zero_centered, dtype, seed=4)
    assert_matches(fast.rms_norm(x, weight, EPS, zero_centered), ref.rms_norm(x, weight, EPS, zero_centered))


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_reads_strided_head_views_in_place(zero_centered: bool) -> None:
    tokens, heads, head_dim = 3, 4, 128
    weight = _weight(zero_centered, torch.bfloat16, seed=5, dim=head_dim)
    # q of a gated attention: [T, H, 2D].chunk -> rows at a stride of 2D (one level of rows).
    q_gate = _randn(tokens, heads, 2 * head_dim, seed=6, dtype=torch.bfloat16)
    q = q_gate.chunk(2, dim=-1)[0]
    # q sliced out of a packed q|k|v projection: tokens and heads at unrelated strides (two levels).
    packed = _randn(tokens, heads * head_dim + 3 * 64, seed=7, dtype=torch.bfloat16)
    q_packed = packed[:, : heads * head_dim].view(tokens, heads, head_dim)
    for view, levels in ((q, 1), (q_packed, 2)):
        num_rows, rows_inner, _ = fast.row_layout(view.shape[:-1], view)
        assert (num_rows, rows_inner > 1) == (tokens * heads, levels == 2)
        assert_matches(fast.rms_norm(view, weight, EPS, zero_centered), ref.rms_norm(view, weight, EPS, zero_centered))


def test_rms_norm_copies_views_it_cannot_index() -> None:
    # Three unmergeable leading dims, and a last-dim stride of 2: both are made contiguous first.
    x = _randn(2, 3, 4, 2 * DIM, seed=8, dtype=torch.bfloat16)[:, :2, :3, :DIM]
    assert fast.row_layout(x.shape[:-1], x) is None
    weight = _weight(False, torch.bfloat16, seed=9)
    assert_matches(fast.rms_norm(x, weight, EPS), ref.rms_norm(x, weight, EPS))
    y = _randn(5, 2 * DIM, seed=10, dtype=torch.bfloat16)[:, ::2]
    assert_matches(fast.rms_norm(y, weight, EPS), ref.rms_norm(y, weight, EPS))


@pytest.mark.parametrize("zero_centered", [False, True])
def test_fp32_weight_on_bf16_rows_keeps_refs_dtypes_and_roundings(zero_centered: bool) -> None:
    # Llama style then multiplies in fp32 and returns fp32; zero-centred and gated return bf16.
    x, residual = _randn(4, 3, DIM, seed=11, dtype=torch.bfloat16), _randn(4, 3, DIM, seed=12, dtype=torch.bfloat16)
    weight = _weight(zero_centered, torch.float32, seed=13)
    assert_matches(fast.rms_norm(x, weight, EPS, zero_centered), ref.rms_norm(x, weight, EPS, zero_centered))
    for out, expected in zip(
        fast.add_rms_norm(x, residual, weight, EPS, zero_centered),
        ref.add_rms_norm(x, residual, weight, EPS, zero_centered),
    ):
        assert_matches(out, expected)
    assert_matches(fast.gated_rms_norm(x, residual, weight, EPS), ref.gated_rms_norm(x, residual, weight, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 6])
def test_add_rms_norm_matches_reference(dtype: torch.dtype, zero_centered: bool, num_tokens: int) -> None:
    x = _randn(num_tokens, DIM, seed=13, dtype=dtype)
    residual = _randn(num_tokens, DIM, seed=14, dtype=dtype, scale=4.0)
    weight = _weight(zero_centered, dtype, seed=15)
    normed, summed = fast.add_rms_norm(x, residual, weight, EPS, zero_centered)
    expected_normed, expected_summed = ref.add_rms_norm(x, residual, weight, EPS, zero_centered)
    assert torch.equal(summed, expected_summed)  # one fp32 add, one rounding: exact
    assert_matches(normed, expected_normed)


def test_add_rms_norm_reads_strided_inputs() -> None:
    x = _randn(5, 2 * DIM, seed=16, dtype=torch.bfloat16)[:, DIM:]
    residual = _randn(5, 3, DIM, seed=17, dtype=torch.bfloat16)[:, 1]
    weight = _weight(True, torch.bfloat16, seed=18)
    normed, summed = fast.add_rms_norm(x, residual, weight, EPS, True)
    expected_normed, expected_summed = ref.add_rms_norm(x, residual, weight, EPS, True)
    assert summed.is_contiguous() and torch.equal(summed, expected_summed)
    assert_matches(normed, expected_normed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_gated_rms_norm_matches_reference(dtype: torch.dtype, num_tokens: int) -> None:
    heads = 5
    x = _randn(num_tokens, heads, DIM, seed=19, dtype=dtype)
    weight = _weight(False, dtype, seed=20)
    # z sliced out of a packed projection: a two-level strided view.
    packed = _randn(num_tokens, heads * DIM + 40, seed=21, dtype=dtype, scale=2.0)
    gate = packed[:, 40:].view(num_tokens, heads, DIM)
    assert_matches(fast.gated_rms_norm(x, gate, weight, EPS), ref.gated_rms_norm(x, gate, weight, EPS))
    gate = gate.contiguous()
    assert_matches(fast.gated_rms_norm(x, gate, weight, EPS), ref.gated_rms_norm(x, gate, weight, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_many_rows_share_programs(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prefill-sized launches put several rows in a program; MANY_ROWS lowered so that 35 rows
    # take that path here (16 per program, the last program partly past the end).
    tokens, heads = 7, 5
    weight = _weight(False, dtype, seed=22)
    packed = _randn(tokens, heads * DIM + 40, seed=23, dtype=dtype, scale=2.0)
    gate = packed[:, 40:].view(tokens, heads, DIM)  # two-level strided rows
    x = _randn(tokens, heads, DIM, seed=24, dtype=dtype)
    one_row = fast.gated_rms_norm(x, gate, weight, EPS)
    monkeypatch.setattr(fast, "MANY_ROWS", 16)
    assert fast.rows_per_program(tokens * heads, 256) == 16
    shared = fast.gated_rms_norm(x, gate, weight, EPS)
    assert torch.equal(shared, one_row)
    assert_matches(shared, ref.gated_rms_norm(x, gate, weight, EPS))


def test_empty_inputs_launch_nothing() -> None:
    x = torch.empty(0, DIM)
    weight = torch.ones(DIM)
    assert fast.rms_norm(x, weight, EPS).shape == (0, DIM)
    normed, summed = fast.add_rms_norm(x, x, weight, EPS)
    assert normed.shape == summed.shape == (0, DIM)
