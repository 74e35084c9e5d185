"""Triton RMSNorm kernels on the GPU vs ref.py at the real widths; CUDA-graph replay vs eager.

Both sides compute in fp32 from the same inputs with the same roundings (see the kernel
module), so bf16 outputs may differ only where fp32 summation order or the rsqrt
approximation moves a value across a bf16 rounding boundary: at most one ulp, on a tiny
fraction of the elements. A missing or extra rounding would change 20-30 % of them.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.backend import fast_impl
from ninfer.kernels.rms_norm import add_rms_norm, gated_rms_norm, ref, rms_norm
from tests.gpu.graph_replay import assert_replay_equals_eager
from tests.ulp import MANTISSA_BITS, assert_matches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

EPS = 1e-6
HIDDEN = {"27B": 5120, "35B-A3B": 2048, "70B": 8192, "odd": 200}
# (q heads, kv heads, head_dim): Qwen3.5-27B, Qwen3.5-35B-A3B, Llama-8B.
ATTENTION = {"27B": (24, 4, 256), "35B-A3B": (16, 2, 256), "llama-8B": (32, 8, 128)}
GDN_HEADS = {"27B": (48, 128), "35B-A3B": (32, 128)}  # (v heads, v head_dim)
TOKENS = (1, 3, 8, 1000)
DTYPES = (torch.bfloat16, torch.float32)


def _ulps(zero_centered: bool) -> int:
    # Llama style rounds normalize(x) to bf16, then multiplies by w: a one-ulp flip of the
    # normalized value (fp32 sum order, rsqrt approximation) is |w| ulps of it, up to 2 of the product.
    return 1 if zero_centered else 2


def _assert_gated_norm_matches(out: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> None:
    """ref.gated_rms_norm rounds normalize(x) to the dtype (n), then w * n to the dtype, then
    multiplies by silu(gate) in fp32 and rounds once more. A one-ulp flip of n (fp32 summation
    order) moves w * n by |w| ulp(n), which its rounding can turn into one more ulp(w * n);
    silu(gate) scales both, and the output rounds on top. Nearly all elements bitwise equal."""
    expected = ref.gated_rms_norm(x, gate, weight, EPS)
    if out.dtype == torch.float32:
        assert_matches(out, expected)
        return

    def ulp(t: torch.Tensor) -> torch.Tensor:
        return torch.ldexp(torch.ones_like(t), torch.frexp(t.abs())[1] - 1 - MANTISSA_BITS[out.dtype])

    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    weighted = (weight * normed).float()
    silu_gate = torch.nn.functional.silu(gate.float()).abs()
    bound = ulp(expected.float()) + (weight.float().abs() * ulp(normed.float()) + ulp(weighted)) * silu_gate
    assert ((out.float() - expected.float()).abs() <= bound).all()
    assert (out != expected).float().mean().item() <= 0.01


def _randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator("cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)


def _weight(dim: int, zero_centered: bool, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return _randn(dim, seed=seed, dtype=torch.float32, scale=0.3).add(0.0 if zero_centered else 1.0).to(dtype)


def test_dispatch_picks_the_triton_kernels() -> None:
    from ninfer.kernels.rms_norm import triton as fast

    x = torch.zeros(1, 8, device="cuda")
    for name in ("rms_norm", "add_rms_norm", "gated_rms_norm"):
        assert fast_impl("ninfer.kernels.rms_norm", name, x) is getattr(fast, name)


@pytest.mark.parametrize("shape", list(HIDDEN))
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_matches_reference(shape: str, num_tokens: int, dtype: torch.dtype, zero_centered: bool) -> None:
    hidden = HIDDEN[shape]
    x = _randn(num_tokens, hidden, seed=num_tokens, dtype=dtype, scale=3.0)
    weight = _weight(hidden, zero_centered, dtype, seed=hidden)
    assert_matches(rms_norm(x, weight, EPS, zero_centered), ref.rms_norm(x, weight, EPS, zero_centered), max_ulps=_ulps(zero_centered))


@pytest.mark.parametrize("shape", list(ATTENTION))
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_head_norms_read_packed_projection_views(shape: str, num_tokens: int, zero_centered: bool) -> None:
    """q and k norms on per-head views of one packed q(+gate)|k|v projection."""
    num_heads, num_kv_heads, head_dim = ATTENTION[shape]
    q_cols, kv_cols = num_heads * 2 * head_dim, num_kv_heads * head_dim
    qkv = _randn(num_tokens, q_cols + 2 * kv_cols, seed=num_tokens, dtype=torch.bfloat16, scale=2.0)
    q_part, k_part, _ = qkv.split([q_cols, kv_cols, kv_cols], dim=-1)
    q = q_part.view(num_tokens, num_heads, 2 * head_dim).chunk(2, dim=-1)[0]
    k = k_part.view(num_tokens, num_kv_heads, head_dim)
    weight = _weight(head_dim, zero_centered, torch.bfloat16, seed=head_dim)
    for view in (q, k):
        expected = ref.rms_norm(view, weight, EPS, zero_centered)
        assert_matches(rms_norm(view, weight, EPS, zero_centered), expected, max_ulps=_ulps(zero_centered))


@pytest.mark.parametrize("shape", list(HIDDEN))
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("early_residual", [False, True])
def test_add_rms_norm_matches_reference(
    shape: str, num_tokens: int, dtype: torch.dtype, zero_centered: bool, early_residual: bool
) -> None:
    hidden = HIDDEN[shape]
    x = _randn(num_tokens, hidden, seed=num_tokens, dtype=dtype)
    residual = _randn(num_tokens, hidden, seed=num_tokens + 1, dtype=dtype, scale=4.0)
    weight = _weight(hidden, zero_centered, dtype, seed=hidden)
    normed, summed = add_rms_norm(x, residual, weight, EPS, zero_centered, early_residual=early_residual)
    expected_normed, expected_summed = ref.add_rms_norm(x, residual, weight, EPS, zero_centered)
    assert torch.equal(summed, expected_summed)  # one fp32 add rounded once, as torch does
    assert_matches(normed, expected_normed)


@pytest.mark.parametrize("shape", list(GDN_HEADS))
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("early_gate", [False, True])
def test_gated_rms_norm_matches_reference(shape: str, num_tokens: int, dtype: torch.dtype, early_gate: bool) -> None:
    """GDN output norm; z sliced out of the packed in_proj output (qkv | z | b | a)."""
    num_heads, head_dim = GDN_HEADS[shape]
    value_dim = num_heads * head_dim
    x = _randn(num_tokens, num_heads, head_dim, seed=num_tokens, dtype=dtype)
    packed = _randn(num_tokens, 2 * value_dim + value_dim + 2 * num_heads, seed=num_tokens + 1, dtype=dtype, scale=2.0)
    gate = packed[:, 2 * value_dim : 3 * value_dim].view(num_tokens, num_heads, head_dim)
    weight = _weight(head_dim, False, dtype, seed=head_dim)
    _assert_gated_norm_matches(gated_rms_norm(x, gate, weight, EPS, early_gate=early_gate), x, gate, weight)


def test_gated_rms_norm_prefill_rows_share_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """8K-token prefill of the 35B-A3B GDN norm (262,144 rows of 128): several rows per program.
    Their fp32 sums may add in another order than one row per program's (the CPU interpreter
    test checks the same bits); both stay within the reference's rounding."""
    from ninfer.kernels.rms_norm import triton as fast

    x = _randn(8192, 32, 128, seed=4, dtype=torch.bfloat16)
    packed = _randn(8192, 4 * 4096 + 64, seed=5, dtype=torch.bfloat16, scale=2.0)
    gate = packed[:, 2 * 4096 : 3 * 4096].view(8192, 32, 128)
    weight = _weight(128, False, torch.bfloat16, seed=6)
    assert fast.rows_per_program(8192 * 32, 128) > 1
    shared = fast.gated_rms_norm(x, gate, weight, EPS)
    _assert_gated_norm_matches(shared, x, gate, weight)
    monkeypatch.setattr(fast, "MANY_ROWS", 1 << 30)
    _assert_gated_norm_matches(fast.gated_rms_norm(x, gate, weight, EPS), x, gate, weight)


def test_gated_rms_norm_head_dim_256() -> None:
    x = _randn(8, 16, 256, seed=1, dtype=torch.bfloat16)
    gate = _randn(8, 16, 256, seed=2, dtype=torch.bfloat16)
    weight = _weight(256, False, torch.bfloat16, seed=3)
    _assert_gated_norm_matches(gated_rms_norm(x, gate, weight, EPS), x, gate, weight)


def test_norms_replay_in_a_cuda_graph() -> None:
    """One decode step's norms (27B widths, 8 tokens) captured once, replayed on new data."""
    num_tokens, hidden = 8, HIDDEN["27B"]
    num_heads, num_kv_heads, head_dim = ATTENTION["27B"]
    gdn_heads, gdn_dim = GDN_HEADS["27B"]
    q_cols, kv_cols = num_heads * 2 * head_dim, num_kv_heads * head_dim

    def fresh(seed: int) -> dict[str, torch.Tensor]:
        return {
            "x": _randn(num_tokens, hidden, seed=seed, dtype=torch.bfloat16),
            "residual": _randn(num_tokens, hidden, seed=seed + 1, dtype=torch.bfloat16, scale=4.0),
            "qkv": _randn(num_tokens, q_cols + 2 * kv_cols, seed=seed + 2, dtype=torch.bfloat16),
            "core": _randn(num_tokens, gdn_heads, gdn_dim, seed=seed + 3, dtype=torch.bfloat16),
            "z": _randn(num_tokens, gdn_heads, gdn_dim, seed=seed + 4, dtype=torch.bfloat16),
        }

    w_hidden = _weight(hidden, True, torch.bfloat16, seed=10)
    w_head = _weight(head_dim, True, torch.bfloat16, seed=11)
    w_gdn = _weight(gdn_dim, False, torch.bfloat16, seed=12)

    def step(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        q = t["qkv"][:, :q_cols].view(num_tokens, num_heads, 2 * head_dim).chunk(2, dim=-1)[0]
        normed, summed = add_rms_norm(t["x"], t["residual"], w_hidden, EPS, True)
        return [
            rms_norm(t["x"], w_hidden, EPS, True),
            normed,
            summed,
            rms_norm(q, w_head, EPS, True),
            gated_rms_norm(t["core"], t["z"], w_gdn, EPS),
        ]

    assert_replay_equals_eager(step, fresh)
