"""Triton GEMV on the GPU at the Qwen3.5 decode shapes vs ref.py; determinism and CUDA-graph replay.

Every (shape, M, weight kind) runs the heuristic's launch: FMA at small M, DOT (tensor
cores, x padded to 16 rows) above, split-K where N is small. The reference is the fp32
product of the dequantized weights, before its final rounding; the kernel also sums in
fp32 (another order) and rounds once to bf16, so it must agree within half a bf16 unit
(2^-8 relative, with margin for the fp32 order) plus a floor of 1e-3 of the output's
largest magnitude for outputs near zero.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels import gemv as gemv_op
from ninfer.kernels.gemv import ref
from ninfer.kernels.gemv import triton as fast

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SHAPES_27B = {
    "27b_gdn_in_proj": (16480, 5120),
    "27b_gdn_out_proj": (5120, 6144),
    "27b_attn_qkv": (14336, 5120),
    "27b_o_proj": (5120, 6144),
    "27b_mlp_gate_up": (34816, 5120),
    "27b_mlp_down": (5120, 17408),
    "27b_lm_head": (248320, 5120),
}
SHAPES_35B = {
    "35b_gdn_in_proj": (12352, 2048),
    "35b_gdn_out_proj": (2048, 4096),
    "35b_shared_gate_up": (1024, 2048),
    "35b_shared_down": (2048, 512),
    "35b_router": (256, 2048),
}
SHAPES = {**SHAPES_27B, **SHAPES_35B}
KINDS = ("bf16", "fp8_channel", "fp8_block")


def make_weight(n: int, k: int, kind: str, seed: int = 0):
    """(weight, weight_scale) of one kind, quantized the way checkpoints are (absmax scales)."""
    gen = torch.Generator("cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
    if kind == "bf16":
        return w.bfloat16(), None
    if kind == "fp8_channel":
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
        return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.zeros(nb * 128, kb * 128, device="cuda")
    padded[:n, :k] = w
    scale = padded.view(nb, 128, kb, 128).abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    quantized = (padded.view(nb, 128, kb, 128) / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return quantized.view(nb * 128, kb * 128)[:n, :k].contiguous().to(FP8), scale


def exact_fp32(x, weight, scale, bias=None) -> torch.Tensor:
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out = x.float() @ ref.dequantize(weight, scale).T
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return out if bias is None else out + bias.float()


def check(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-3 * expected.abs().max().item())


@pytest.fixture(scope="module")
def weights():
    cache = {}

    def get(name: str, kind: str):
        if (name, kind) not in cache:
            cache.clear()  # one shape's weights at a time (lm_head is 2.5 GB in bf16)
            cache[(name, kind)] = make_weight(*SHAPES[name], kind)
        return cache[(name, kind)]

    return get


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("m", [1, 2, 8, 16])
def test_matches_reference(name: str, kind: str, m: int, weights) -> None:
    n, k = SHAPES[name]
    weight, scale = weights(name, kind)
    x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).bfloat16()
    out = gemv_op.gemv(x, weight, scale)
    cfg = fast._config(m, n, k, weight.dtype, torch.cuda.get_device_properties(0).multi_processor_count)
    print(f"METRIC gemv {name} {kind} M={m} config={tuple(cfg)}")
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    check(out, exact_fp32(x, weight, scale))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [3, 16])
def test_bias_and_strided_rows(kind: str, m: int) -> None:
    n, k = 5120, 6144
    weight, scale = make_weight(n, k, kind, seed=1)
    gen = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(m, k + 64, device="cuda", generator=gen).bfloat16()[:, :k]  # row stride k + 64
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    check(gemv_op.gemv(x, weight, scale, bias), exact_fp32(x, weight, scale, bias))


# Split-K (35B out_proj), FMA and DOT, each weight kind; the sweep's alternatives in the bench.
CONFIG_CASES = [
    ("35b_gdn_out_proj", "bf16", 1, None),
    ("35b_gdn_out_proj", "fp8_block", 16, None),
    ("27b_o_proj", "fp8_channel", 2, None),
    ("27b_o_proj", "bf16", 16, fast.Config(32, 256, 4, 3, True, 4)),
    ("27b_o_proj", "fp8_block", 4, fast.Config(4, 2048, 4, 1, False, 2)),
]


@pytest.mark.parametrize("name, kind, m, config", CONFIG_CASES)
def test_deterministic(name: str, kind: str, m: int, config) -> None:
    n, k = SHAPES[name]
    weight, scale = make_weight(n, k, kind, seed=3)
    x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(4)).bfloat16()
    first = fast.gemv(x, weight, scale, config=config)
    for _ in range(3):
        assert torch.equal(fast.gemv(x, weight, scale, config=config), first)
    check(first, exact_fp32(x, weight, scale))


@pytest.mark.parametrize("name, kind, m, config", CONFIG_CASES)
def test_cuda_graph_replay_equals_eager(name: str, kind: str, m: int, config) -> None:
    n, k = SHAPES[name]
    weight, scale = make_weight(n, k, kind, seed=5)
    gen = torch.Generator("cuda").manual_seed(6)
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    x_static = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    fast.gemv(x_static, weight, scale, bias, config=config)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = fast.gemv(x_static, weight, scale, bias, config=config)
    for step in range(3):
        x_static.copy_(torch.randn(m, k, device="cuda", generator=gen).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        eager = fast.gemv(x_static, weight, scale, bias, config=config)
        assert torch.equal(out_static, eager), f"step {step}"
