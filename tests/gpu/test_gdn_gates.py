"""Triton GDN gates on the GPU vs ref.py at the real head counts; CUDA-graph replay.

Both sides compute the same fp32 formula from the same inputs; the kernel's exp is
ex2.approx (relative error ~1e-6 over the input range) and its log1p is log-based, so g and
beta agree to ~1e-5 relative, not bitwise.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.gated_delta_rule import gdn_gates, ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NUM_V_HEADS = {"27B": 48, "35B-A3B": 32}
ATOL, RTOL = 1e-6, 1e-5


def _packed(num_tokens: int, num_heads: int, seed: int) -> torch.Tensor:
    """A bf16 projection output [T, C] holding b and a side by side among other columns."""
    gen = torch.Generator("cuda").manual_seed(seed)
    return (torch.randn(num_tokens, 2 * num_heads + 24, device="cuda", generator=gen) * 4).bfloat16()


def _views(packed: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    return packed[:, 16 : 16 + num_heads], packed[:, 16 + num_heads : 16 + 2 * num_heads]  # b, a


def _params(num_heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator("cuda").manual_seed(num_heads)
    A_log = (torch.rand(num_heads, device="cuda", generator=gen) * 4 - 2).to(dtype)
    dt_bias = torch.randn(num_heads, device="cuda", generator=gen).to(dtype)
    return A_log, dt_bias


@pytest.mark.parametrize("shape", list(NUM_V_HEADS))
@pytest.mark.parametrize("num_tokens", [1, 8, 1000])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_gates_match_reference(shape: str, num_tokens: int, param_dtype: torch.dtype) -> None:
    num_heads = NUM_V_HEADS[shape]
    b, a = _views(_packed(num_tokens, num_heads, seed=num_tokens), num_heads)
    A_log, dt_bias = _params(num_heads, param_dtype)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    g_ref, beta_ref = ref.gdn_gates(a, b, A_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32 and g.is_contiguous() and beta.is_contiguous()
    torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(beta, beta_ref, atol=ATOL, rtol=RTOL)


def test_softplus_threshold_and_tails() -> None:
    x = torch.tensor([-100.0, -30.0, -17.0, -1.0, 0.0, 1.0, 19.5, 19.99, 20.0, 20.01, 21.0, 50.0, 100.0, 300.0])
    num_heads = x.numel()
    a = torch.stack((x - 0.5, -(x - 0.5))).cuda()
    A_log = torch.linspace(-3, 3, num_heads, device="cuda")
    g, beta = gdn_gates(a, a.flip(0), A_log, torch.full((num_heads,), 0.5, device="cuda"))
    g_ref, beta_ref = ref.gdn_gates(a, a.flip(0), A_log, torch.full((num_heads,), 0.5, device="cuda"))
    assert torch.isfinite(g).all() and torch.isfinite(beta).all()
    torch.testing.assert_close(g, g_ref, atol=1e-30, rtol=RTOL)  # exp flushes e^-100 to 0
    torch.testing.assert_close(beta, beta_ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_tokens", [1, 8])
def test_replays_in_a_cuda_graph(num_tokens: int) -> None:
    num_heads = NUM_V_HEADS["27B"]
    packed = _packed(num_tokens, num_heads, seed=0)
    b, a = _views(packed, num_heads)
    A_log, dt_bias = _params(num_heads, torch.bfloat16)
    gdn_gates(a, b, A_log, dt_bias)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_g, static_beta = gdn_gates(a, b, A_log, dt_bias)
    for seed in (1, 2, 3):
        new = _packed(num_tokens, num_heads, seed=seed)
        new_b, new_a = _views(new, num_heads)
        eager_g, eager_beta = gdn_gates(new_a, new_b, A_log, dt_bias)
        packed.copy_(new)
        graph.replay()
        assert torch.equal(static_g, eager_g)
        assert torch.equal(static_beta, eager_beta)
