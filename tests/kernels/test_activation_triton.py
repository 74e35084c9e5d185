"""Our Triton silu_and_mul / sigmoid_mul kernels under Triton's CPU interpreter vs ref.py.

As in test_rms_norm_triton.py, the interpreter is given the GPU's fp32 -> bf16 rounding
(nearest even; it truncates by default) so that bf16 results can be held to torch's
roundings: almost all elements bitwise equal, none more than one ulp apart. The compiled
kernels at the real shapes are tested in tests/gpu/test_activation.py.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.activation import ref
from tests.kernels.interpreter import (  # noqa: F401 (fixtures)
    bf16_round_to_nearest_even,
    cpu_interpreter,
    interpreted,
)
from tests.ulp import assert_matches

pytestmark = pytest.mark.usefixtures("bf16_round_to_nearest_even")

fast = interpreted("ninfer.kernels.activation.triton")

def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("inter", [200, 1500])  # one partial column block; two blocks of 1024
def test_silu_and_mul_matches_reference(dtype: torch.dtype, num_tokens: int, inter: int) -> None:
    x = _randn(num_tokens, 2 * inter, seed=inter + num_tokens, dtype=dtype)
    assert_matches(fast.silu_and_mul(x), ref.silu_and_mul(x))


def test_silu_and_mul_reads_strided_rows() -> None:
    inter = 200
    # gate|up sliced out of a wider packed projection, and a 3-D [T, H, 2I] input with a gap per head.
    packed = _randn(4, 2 * inter + 24, seed=1, dtype=torch.bfloat16)[:, 24:]
    per_head = _randn(3, 2, 2 * inter + 8, seed=2, dtype=torch.bfloat16)[..., : 2 * inter]
    for x in (packed, per_head):
        assert not x.is_contiguous()
        assert_matches(fast.silu_and_mul(x), ref.silu_and_mul(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_sigmoid_mul_full_gate_matches_reference(dtype: torch.dtype, num_tokens: int) -> None:
    x, gate = _randn(num_tokens, 1100, seed=3, dtype=dtype), _randn(num_tokens, 1100, seed=4, dtype=dtype)
    assert_matches(fast.sigmoid_mul(x, gate), ref.sigmoid_mul(x, gate))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_sigmoid_mul_row_gate_matches_reference(dtype: torch.dtype, num_tokens: int) -> None:
    # The MoE shared-expert gate: one logit per token, here a column of a wider tensor.
    x = _randn(num_tokens, 300, seed=5, dtype=dtype)
    gate = _randn(num_tokens, 7, seed=6, dtype=dtype)[:, 2:3]
    assert_matches(fast.sigmoid_mul(x, gate), ref.sigmoid_mul(x, gate))


def test_sigmoid_mul_attention_gate_views() -> None:
    tokens, heads, head_dim = 3, 4, 128
    out = _randn(tokens, heads, head_dim, seed=7, dtype=torch.bfloat16)
    # Gated attention: q|gate interleaved per head in the q projection, which itself is a slice of q|k|v.
    packed = _randn(tokens, heads * 2 * head_dim + 2 * 64, seed=8, dtype=torch.bfloat16)
    gate_packed = packed[:, : heads * 2 * head_dim].view(tokens, heads, 2 * head_dim).chunk(2, dim=-1)[1]
    gate_chunk = _randn(tokens, heads, 2 * head_dim, seed=9, dtype=torch.bfloat16).chunk(2, dim=-1)[1]
    for gate in (gate_packed, gate_chunk):
        assert_matches(fast.sigmoid_mul(out, gate), ref.sigmoid_mul(out, gate))


def test_sigmoid_mul_promotes_like_torch() -> None:
    x = _randn(2, 200, seed=10, dtype=torch.bfloat16)
    gate = _randn(2, 1, seed=11)  # fp32 gate: fp32 product
    assert_matches(fast.sigmoid_mul(x, gate), ref.sigmoid_mul(x, gate))


def test_sigmoid_mul_rejects_other_broadcasts() -> None:
    with pytest.raises(ValueError):
        fast.sigmoid_mul(torch.randn(4, 8), torch.randn(1, 8))


def test_sigmoid_mul_many_rows_share_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill-sized launches put several rows in a program (MANY_ROWS lowered here so that a
    few dozen rows take that path): same bits as one row per program, for all gate forms."""
    tokens, heads, head_dim = 9, 4, 128
    out = _randn(tokens, heads, head_dim, seed=12, dtype=torch.bfloat16)
    packed = _randn(tokens, heads * 2 * head_dim + 2 * 64, seed=13, dtype=torch.bfloat16)
    attention_gate = packed[:, : heads * 2 * head_dim].view(tokens, heads, 2 * head_dim).chunk(2, dim=-1)[1]
    cases = [
        (out, attention_gate),  # 36 two-level strided rows of 128: 32 per program
        (_randn(37, 1100, seed=14, dtype=torch.bfloat16), _randn(37, 1100, seed=15, dtype=torch.bfloat16)),
        (_randn(40, 300, seed=16, dtype=torch.bfloat16), _randn(40, 7, seed=17, dtype=torch.bfloat16)[:, 2:3]),
        (_randn(40, 1, seed=18, dtype=torch.bfloat16), _randn(40, 1, seed=19, dtype=torch.bfloat16)),  # 64 rows of 1
    ]
    one_row = [fast.sigmoid_mul(x, gate) for x, gate in cases]
    monkeypatch.setitem(fast.rows_per_program.__globals__, "MANY_ROWS", 16)
    for (x, gate), expected in zip(cases, one_row):
        assert fast.rows_per_program(x.numel() // x.shape[-1], 128) > 1
        shared = fast.sigmoid_mul(x, gate)
        assert torch.equal(shared, expected)
        assert_matches(shared, ref.sigmoid_mul(x, gate))
