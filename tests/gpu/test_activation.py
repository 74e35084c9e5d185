"""Triton silu_and_mul / sigmoid_mul on the GPU vs ref.py at the real widths; CUDA-graph replay vs eager.

Both sides compute silu/sigmoid in fp32, round to the dtype, then round the product (see the
kernel module); bf16 outputs may differ only where exp's approximation moves a value across
a rounding boundary: at most one ulp, on a tiny fraction of the elements. Skipping either
rounding would change 10-35 % of them.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.activation import ref, sigmoid_mul, silu_and_mul
from ninfer.kernels.backend import fast_impl
from tests.gpu.graph_replay import assert_replay_equals_eager
from tests.ulp import assert_matches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# MLP intermediate sizes: Qwen3.5-27B dense MLP, 35B-A3B shared expert, Llama-8B.
INTERMEDIATE = {"27B": 17408, "35B-A3B shared": 512, "llama-8B": 14336}
# (q heads, head_dim) of the gated attention output.
ATTENTION = {"27B": (24, 256), "35B-A3B": (16, 256)}
HIDDEN = {"27B": 5120, "35B-A3B": 2048}
TOKENS = (1, 3, 8, 1000)
DTYPES = (torch.bfloat16, torch.float32)


def _randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 2.0) -> torch.Tensor:
    gen = torch.Generator("cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)


def test_dispatch_picks_the_triton_kernels() -> None:
    from ninfer.kernels.activation import triton as fast

    x = torch.zeros(1, 8, device="cuda")
    for name in ("silu_and_mul", "sigmoid_mul"):
        assert fast_impl("ninfer.kernels.activation", name, x) is getattr(fast, name)


@pytest.mark.parametrize("shape", list(INTERMEDIATE))
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(shape: str, num_tokens: int, dtype: torch.dtype) -> None:
    x = _randn(num_tokens, 2 * INTERMEDIATE[shape], seed=num_tokens, dtype=dtype)
    assert_matches(silu_and_mul(x), ref.silu_and_mul(x))


@pytest.mark.parametrize("num_tokens", TOKENS)
def test_silu_and_mul_reads_strided_rows(num_tokens: int) -> None:
    inter = INTERMEDIATE["35B-A3B shared"]
    x = _randn(num_tokens, 2 * inter + 64, seed=num_tokens, dtype=torch.bfloat16)[:, 64:]
    assert_matches(silu_and_mul(x), ref.silu_and_mul(x))


@pytest.mark.parametrize("shape", list(ATTENTION))
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_mul_attention_gate(shape: str, num_tokens: int, dtype: torch.dtype) -> None:
    """The gate is the second half of each head's q|gate pair, in a packed q|k|v projection."""
    num_heads, head_dim = ATTENTION[shape]
    q_cols = num_heads * 2 * head_dim
    out = _randn(num_tokens, num_heads, head_dim, seed=num_tokens, dtype=dtype)
    qkv = _randn(num_tokens, q_cols + 4 * head_dim, seed=num_tokens + 1, dtype=dtype)
    gate = qkv[:, :q_cols].view(num_tokens, num_heads, 2 * head_dim).chunk(2, dim=-1)[1]
    assert_matches(sigmoid_mul(out, gate), ref.sigmoid_mul(out, gate))
    flat_out, flat_gate = out.view(num_tokens, -1), gate.reshape(num_tokens, -1)  # the gate: a contiguous copy
    assert_matches(sigmoid_mul(flat_out, flat_gate), ref.sigmoid_mul(flat_out, flat_gate))


@pytest.mark.parametrize("shape", list(HIDDEN))
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_mul_shared_expert_gate(shape: str, num_tokens: int, dtype: torch.dtype) -> None:
    x = _randn(num_tokens, HIDDEN[shape], seed=num_tokens, dtype=dtype)
    gate = _randn(num_tokens, 1, seed=num_tokens + 1, dtype=dtype)
    assert_matches(sigmoid_mul(x, gate), ref.sigmoid_mul(x, gate))


def test_activations_replay_in_a_cuda_graph() -> None:
    num_tokens = 8
    inter, hidden = INTERMEDIATE["27B"], HIDDEN["27B"]
    num_heads, head_dim = ATTENTION["27B"]

    def fresh(seed: int) -> dict[str, torch.Tensor]:
        return {
            "gate_up": _randn(num_tokens, 2 * inter, seed=seed, dtype=torch.bfloat16),
            "attn": _randn(num_tokens, num_heads, head_dim, seed=seed + 1, dtype=torch.bfloat16),
            "q_gate": _randn(num_tokens, num_heads, 2 * head_dim, seed=seed + 2, dtype=torch.bfloat16),
            "shared": _randn(num_tokens, hidden, seed=seed + 3, dtype=torch.bfloat16),
            "shared_gate": _randn(num_tokens, 1, seed=seed + 4, dtype=torch.bfloat16),
        }

    def step(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [
            silu_and_mul(t["gate_up"]),
            sigmoid_mul(t["attn"], t["q_gate"].chunk(2, dim=-1)[1]),
            sigmoid_mul(t["shared"], t["shared_gate"]),
        ]

    assert_replay_equals_eager(step, fresh)


def test_sigmoid_mul_prefill_rows_share_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """8K-token prefill of the 35B-A3B attention output gate (131,072 rows of 256, read from the
    packed q projection) and shared-expert gate: several rows per program, same bits as one."""
    from ninfer.kernels.activation import triton as fast
    from ninfer.kernels.rms_norm import triton as norms

    tokens, heads, head_dim = 8192, 16, 256
    out = _randn(tokens, heads, head_dim, seed=1, dtype=torch.bfloat16)
    q_gate = _randn(tokens, heads, 2 * head_dim, seed=2, dtype=torch.bfloat16).chunk(2, dim=-1)[1]
    shared_in = _randn(tokens, 2048, seed=3, dtype=torch.bfloat16)
    shared_gate = _randn(tokens, 1, seed=4, dtype=torch.bfloat16)
    cases = [(out, q_gate), (shared_in, shared_gate)]
    assert fast.rows_per_program(tokens * heads, 256) > 1
    shared = [sigmoid_mul(x, gate) for x, gate in cases]
    monkeypatch.setattr(norms, "MANY_ROWS", 1 << 30)
    for (x, gate), got in zip(cases, shared):
        assert torch.equal(got, sigmoid_mul(x, gate))
        assert_matches(got, ref.sigmoid_mul(x, gate))
