"""Triton GEMV on the GPU at the Qwen3.5 decode shapes vs ref.py; determinism and CUDA-graph replay.

Every (shape, M, weight kind) runs the heuristic's launch: FMA at small M, DOT (tensor
cores; bf16 weights with x padded to 16 rows, FP8 weights as the MMA's A operand with x^T
padded to 8 or 16 columns) above, split-K where N is small. The reference is the fp32
product of the dequantized weights, before its final rounding; the kernel also sums in
fp32 (another order) and rounds once to bf16, so it must agree within half a bf16 unit
(2^-8 relative, with margin for the fp32 order) plus a floor of 1e-3 of the output's
largest magnitude for outputs near zero. FP8 kinds: per-channel scales, 128 x 128 block
scales, and row blocks (several projections packed along N, each block-quantized on its
own, the scales stored per row [N, ceil(K/128)]). Also: the inline-PTX e4m3 -> bf16 bit moves on
all 256 codes, tiny activations through FP8 DOT (products far below fp32's normal range
before the scale fold), and PDL launches chained in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="the GEMV kernels are Triton code")
import triton.language as tl  # noqa: E402

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
KINDS = ("bf16", "fp8_channel", "fp8_block", "fp8_rows")


def make_weight(n: int, k: int, kind: str, seed: int = 0):
    """(weight, weight_scale) of one kind, quantized the way checkpoints are (absmax scales)."""
    gen = torch.Generator("cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
    if kind == "bf16":
        return w.bfloat16(), None
    if kind == "fp8_channel":
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
        return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    if kind == "fp8_block":
        return quantize_blocks(w)
    # fp8_rows: parts packed along N whose 128-row blocks do not line up (like the loader's
    # [10240 | 6144 | 48 | 48]), each quantized in 128 x 128 blocks, scales expanded per row.
    cuts = sorted({0, min(n, n // 2 + 40), max(0, n - 48), n})
    parts = [quantize_blocks(w[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]
    rows = torch.cat([scale.repeat_interleave(128, dim=0)[: q.shape[0]] for q, scale in parts])
    return torch.cat([q for q, _ in parts]), rows


def quantize_blocks(w: torch.Tensor):
    """(fp8 [n, k], scale [ceil(n/128), ceil(k/128)]): 128 x 128 absmax blocks."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.zeros(nb * 128, kb * 128, device=w.device)
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
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 24, 32])
def test_matches_reference(name: str, kind: str, m: int, weights) -> None:
    n, k = SHAPES[name]
    weight, scale = weights(name, kind)
    x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).bfloat16()
    out = gemv_op.gemv(x, weight, scale)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    check(out, exact_fp32(x, weight, scale))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [3, 16, 27])
def test_bias_and_strided_rows(kind: str, m: int) -> None:
    n, k = 5120, 6144
    weight, scale = make_weight(n, k, kind, seed=1)
    gen = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(m, k + 64, device="cuda", generator=gen).bfloat16()[:, :k]  # row stride k + 64
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    check(gemv_op.gemv(x, weight, scale, bias), exact_fp32(x, weight, scale, bias))


GATE_UP = ["27b_mlp_gate_up", "35b_shared_gate_up"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", GATE_UP)
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 24, 32])
def test_silu_and_mul_epilogue_equals_the_two_launches(
    name: str, kind: str, m: int, weights, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gemv_silu_and_mul's default launch (gate and up rows paired in each FMA program; tensor-core
    and split-K launches run the two kernels) vs the plain GEMV with that launch then
    silu_and_mul: the same bits; and the reference's values."""
    from ninfer.kernels.activation import ref as activation_ref
    from ninfer.kernels.activation import silu_and_mul

    fallbacks = []
    monkeypatch.setattr(fast, "silu_and_mul", lambda t: fallbacks.append(t.shape) or silu_and_mul(t))

    n, k = SHAPES[name]
    weight, scale = weights(name, kind)
    gen = torch.Generator("cuda").manual_seed(10 + m)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16() if m == 2 else None
    fused = gemv_op.gemv_silu_and_mul(x, weight, scale, bias)
    cfg = fast._config(m, n, k, weight.dtype, torch.cuda.get_device_properties(0).multi_processor_count, 2)
    assert cfg.block_n % 2 == 0
    assert len(fallbacks) == int(cfg.use_dot or cfg.split_k > 1)
    if name == "27b_mlp_gate_up" and m <= 2:
        assert not fallbacks  # the one- and two-row decode sizes run the epilogue
    assert fused.shape == (m, n // 2) and fused.dtype == torch.bfloat16
    assert torch.equal(fused, silu_and_mul(fast.gemv(x, weight, scale, bias, config=cfg)))
    expected = activation_ref.silu_and_mul(exact_fp32(x, weight, scale, bias).bfloat16())
    torch.testing.assert_close(fused.float(), expected.float(), rtol=2**-6, atol=2e-3 * expected.abs().max().item())


CONV_IN_PROJ = {"27b_gdn_in_proj": 10240, "35b_gdn_in_proj": 8192}  # q | k | v channels of the conv


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(CONV_IN_PROJ))
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 24, 32])
def test_conv_epilogue_equals_the_two_launches(name: str, kind: str, m: int, weights) -> None:
    """gemv_causal_conv1d_update's default launch vs the plain GEMV with that launch, then
    causal_conv1d_update on the conv channels: the same output and state bits."""
    from ninfer.kernels.causal_conv1d import causal_conv1d_update

    n, k = SHAPES[name]
    channels = CONV_IN_PROJ[name]
    weight, scale = weights(name, kind)
    gen = torch.Generator("cuda").manual_seed(20 + m)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    conv_weight = (torch.randn(channels, 4, device="cuda", generator=gen) * 0.5).bfloat16()
    state = torch.randn(m + 3, channels, 3, device="cuda", generator=gen).bfloat16()
    slots = torch.randperm(m + 3, device="cuda", generator=gen)[:m]
    fused_state, plain_state = state.clone(), state.clone()
    fused = gemv_op.gemv_causal_conv1d_update(x, weight, scale, None, conv_weight, fused_state, slots)
    cfg = fast._config(m, n, k, weight.dtype, torch.cuda.get_device_properties(0).multi_processor_count)
    plain = fast.gemv(x, weight, scale, config=cfg)
    mixed = causal_conv1d_update(plain[:, :channels], conv_weight, plain_state, slots)
    assert torch.equal(fused[:, :channels], mixed) and torch.equal(fused[:, channels:], plain[:, channels:])
    assert torch.equal(fused_state, plain_state) and not torch.equal(fused_state, state)


# Split-K (35B out_proj), FMA and DOT, each weight kind; the sweep's alternatives in the bench.
CONFIG_CASES = [
    ("35b_gdn_out_proj", "bf16", 1, None),
    ("35b_gdn_out_proj", "fp8_block", 16, None),
    ("27b_o_proj", "fp8_channel", 2, None),
    ("27b_o_proj", "bf16", 16, fast.Config(32, 256, 4, 3, True, 4)),
    ("27b_o_proj", "fp8_block", 4, fast.Config(4, 2048, 4, 1, False, 2)),
    ("27b_o_proj", "fp8_channel", 8, fast.Config(16, 256, 2, 3, True, 1)),  # 2 warps share 16 rows
    ("27b_o_proj", "fp8_block", 16, fast.Config(128, 256, 2, 3, True, 2)),
    ("35b_gdn_out_proj", "fp8_rows", 1, None),
    ("27b_o_proj", "fp8_rows", 2, None),
    ("27b_o_proj", "fp8_rows", 16, fast.Config(128, 256, 2, 3, True, 2)),
    # FMA with the next weight tile loaded early (the first before the PDL wait), split-K too
    ("27b_o_proj", "fp8_channel", 1, fast.Config(4, 1024, 2, 1, prefetch=True)),
    ("27b_mlp_down", "bf16", 1, fast.Config(4, 2048, 4, 1, prefetch=True)),
    ("35b_gdn_out_proj", "fp8_block", 2, fast.Config(2, 2048, 2, 1, split_k=4, prefetch=True)),
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


@triton.jit
def _convert_kernel(w_ptr, out_ptr, ASM: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, fast._e4m3_bits(tl.load(w_ptr + i), tl.bfloat16, ASM))


@pytest.mark.parametrize("asm", [False, True])
def test_e4m3_bits_all_codes(asm: bool) -> None:
    # FP8 DOT's conversion: every e4m3 code (subnormals, -0) is its value times 2^-120, in bits.
    w = torch.arange(256, dtype=torch.uint8, device="cuda").view(FP8)
    out = torch.empty(256, dtype=torch.bfloat16, device="cuda")
    _convert_kernel[(1,)](w, out, ASM=asm)
    finite = ~torch.isnan(w.float())
    assert torch.equal(out.double()[finite] * 2.0**120, w.double()[finite])
    assert torch.equal(torch.signbit(out.float()[finite]), torch.signbit(w.float()[finite]))


@pytest.mark.parametrize("kind", ["fp8_channel", "fp8_block", "fp8_rows"])
@pytest.mark.parametrize("m", [4, 16])
def test_fp8_dot_tiny_activations(kind: str, m: int) -> None:
    # x ~ 1e-6: most products x * w (e4m3 units) are below 2^-6, i.e. below fp32's normal range
    # if the weights were only shifted into bf16 (times 2^-120); x' = x * 2^64 keeps them normal.
    n, k = 5120, 6144
    weight, scale = make_weight(n, k, kind, seed=7)
    x = (torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(8)) * 1e-6).bfloat16()
    cfg = fast._config(m, n, k, weight.dtype, torch.cuda.get_device_properties(0).multi_processor_count)
    assert cfg.use_dot
    check(fast.gemv(x, weight, scale), exact_fp32(x, weight, scale))


# Dependent chain for PDL: K of each layer is N of the one before; FMA (M=1), DOT (4, 16),
# split-K (N=2048 and 1040, with its sum kernel), the three FP8 scale layouts and bf16.
CHAIN = [
    (6144, 5120, "bf16"),
    (5120, 6144, "fp8_channel"),
    (2048, 5120, "fp8_block"),
    (4096, 2048, "bf16"),
    (5120, 4096, "fp8_channel"),
    (1040, 5120, "fp8_rows"),
]


@pytest.mark.parametrize("m", [1, 4, 16])
def test_pdl_graph_chain_equals_eager(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    layers = [make_weight(n, k, kind, seed=10 + i) for i, (n, k, kind) in enumerate(CHAIN)]
    gen = torch.Generator("cuda").manual_seed(m)

    def chain(x):
        outs = []
        for weight, scale in layers:
            x = fast.gemv(x, weight, scale)
            outs.append(x)
        return outs

    x_static = torch.randn(m, CHAIN[0][1], device="cuda", generator=gen).bfloat16()
    monkeypatch.setenv("NINFER_PDL", "0")
    assert not fast.pdl_enabled(x_static)
    eager_off = chain(x_static)
    monkeypatch.setenv("NINFER_PDL", "1")
    assert fast.pdl_enabled(x_static)  # sm_90+: the PDL variants really run
    for a, b in zip(chain(x_static), eager_off):  # also compiles them outside the capture
        assert torch.equal(a, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs_static = chain(x_static)
    for step in range(3):
        x_static.copy_(torch.randn(m, CHAIN[0][1], device="cuda", generator=gen).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv("NINFER_PDL", "0")
        expected = chain(x_static)
        monkeypatch.setenv("NINFER_PDL", "1")
        for i, (got, want) in enumerate(zip(outs_static, expected)):
            assert torch.equal(got, want), f"step {step}, layer {i}"
