"""Our Triton GDN gates kernel (g, beta from the a/b projections) under Triton's CPU interpreter vs ref.py.

The compiled kernel at the real head counts is tested in tests/gpu/test_gdn_gates.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer.kernels.gated_delta_rule import ref
from tests.kernels.interpreter import cpu_interpreter, interpreted  # noqa: F401 (autouse fixture)

fast = interpreted("ninfer.kernels.gated_delta_rule.triton")

# Same fp32 formula on both sides; only exp/log1p/sigmoid implementations differ (a few ulp).
ATOL, RTOL = 1e-6, 1e-5


def _inputs(num_tokens: int, num_heads: int, dtype: torch.dtype, param_dtype: torch.dtype, seed: int, scale=3.0):
    """a, b as strided column slices of one packed projection output [T, C], as the layer gets them."""
    gen = torch.Generator().manual_seed(seed)
    packed = (torch.randn(num_tokens, 3 * num_heads + 7, generator=gen) * scale).to(dtype)
    b = packed[:, 5 : 5 + num_heads]
    a = packed[:, 5 + num_heads + 2 : 5 + 2 * num_heads + 2]
    A_log = (torch.rand(num_heads, generator=gen) * 4 - 2).to(param_dtype)
    dt_bias = torch.randn(num_heads, generator=gen).to(param_dtype)
    return a, b, A_log, dt_bias


@pytest.mark.parametrize("num_heads", [48, 32, 5])
@pytest.mark.parametrize("num_tokens", [1, 3, 37])  # 37: over two 16-row blocks, the last one partial
@pytest.mark.parametrize("dtype, param_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_gates_match_reference(num_heads: int, num_tokens: int, dtype: torch.dtype, param_dtype: torch.dtype) -> None:
    a, b, A_log, dt_bias = _inputs(num_tokens, num_heads, dtype, param_dtype, seed=num_heads + num_tokens)
    assert a.stride() == b.stride() == (3 * num_heads + 7, 1)  # rows of the packed output
    g, beta = fast.gdn_gates(a, b, A_log, dt_bias)
    g_ref, beta_ref = ref.gdn_gates(a, b, A_log, dt_bias)
    for out in (g, beta):
        assert out.dtype == torch.float32 and out.shape == (num_tokens, num_heads) and out.is_contiguous()
    torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(beta, beta_ref, atol=ATOL, rtol=RTOL)


# tl.sigmoid(-300) = 1 / (1 + exp(300)) = 1 / inf = 0 as intended; numpy warns about the inf.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_softplus_threshold_and_tails() -> None:
    # a + dt_bias spans both sides of softplus's threshold (20), its far negative tail
    # (log1p keeps exp(x) there) and values where exp(x) would overflow (past ~88).
    x = torch.tensor([-100.0, -30.0, -17.0, -1.0, 0.0, 1.0, 19.5, 19.99, 20.0, 20.01, 21.0, 50.0, 100.0, 300.0])
    num_heads = x.numel()
    dt_bias = torch.full((num_heads,), 0.5)
    a = torch.stack((x - 0.5, -(x - 0.5)))  # [2, H] fp32, the second row mirrors the first
    b = a.flip(0)
    A_log = torch.linspace(-3, 3, num_heads)
    g, beta = fast.gdn_gates(a, b, A_log, dt_bias)
    g_ref, beta_ref = ref.gdn_gates(a, b, A_log, dt_bias)
    assert torch.isfinite(g).all() and torch.isfinite(beta).all()
    torch.testing.assert_close(g, g_ref, atol=1e-30, rtol=RTOL)  # GPU exp flushes denormals (x = -100)
    torch.testing.assert_close(beta, beta_ref, atol=ATOL, rtol=RTOL)
    # Above the threshold softplus is the identity: g = -exp(A_log) * x to the last bit of x.
    above = x > 20.0
    expected_above = -A_log.exp()[above] * x[above]
    torch.testing.assert_close(g[0, above], expected_above, atol=0.0, rtol=1e-6)
    torch.testing.assert_close(F.softplus(x), -g[0] / A_log.exp(), atol=1e-30, rtol=1e-5)


def test_no_tokens() -> None:
    a, b, A_log, dt_bias = _inputs(0, 48, torch.bfloat16, torch.bfloat16, seed=0)
    g, beta = fast.gdn_gates(a, b, A_log, dt_bias)
    assert g.shape == beta.shape == (0, 48)
