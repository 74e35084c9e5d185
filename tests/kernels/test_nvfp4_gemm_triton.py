"""The NVFP4 GEMM (prefill sizes): its reference on the CPU, the Triton kernel against it under
Triton's CPU interpreter, and (marked gpu) compiled on CUDA at the 27B prefill shapes.

The kernel feeds the tensor cores value(code) * block_scale in bf16 or fp16 and counts on that
product being exact: checked here for all 16 codes times all 254 finite e4m3 scales, in
torch and through the kernel's own tile decode.

Interpreter shapes are small and odd: N = 200 (a partial weight tile, clamped rows, masked
store), M = 17 and 40 (partial row tiles), K = 80 (a half-masked last step with 64-wide steps)
and 256. Codes are random bytes (all 16 codes, -0 included), block scales span e4m3 from
subnormals to 448 with a fifth of the blocks zero, row scales span 2^-6..2^2 (fp16: 2^-10
lower, to keep the sums in its range).

The interpreter's tl.dot multiplies bf16 operands as raw integers (it stores bf16 as uint16),
so the bf16 tests widen them to fp32 first (exact, as the tensor cores' products are).

Tolerances, against a float64 product of the reference's dequantized weight: the kernel's
products are exact and its sums fp32 in its own order, and it multiplies the row scale into
the total where the reference rounds block_scale * row_scale first; the output is rounded
once to nearest (the interpreter's fp32 -> bf16 made to round as the GPU does): half a unit
in the last place relative, plus 1e-5 of the largest output for the fp32 sums.

The interpreter module skips itself where a GPU is present, which would take the gpu tests
with it; so this file imports it only on CPU-only machines, and marks which tests need which.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ninfer.kernels import nvfp4_gemm as gemm_op
from ninfer.kernels.nvfp4_gemv.ref import MAX_ROWS
from ninfer.kernels.nvfp4_gemm import ref
from ninfer.kernels.nvfp4_gemv import ref as nvfp4_ref
from tests.kernels.nvfp4_samples import exact_product, random_activations, random_weights

ON_GPU = torch.cuda.is_available()
if ON_GPU:
    pytest.importorskip("triton")
    from ninfer.kernels.nvfp4_gemm import triton as fast
else:
    from tests.kernels.interpreter import (  # noqa: F401 (fixtures)
        bf16_round_to_nearest_even,
        cpu_interpreter,
        interpreted,
    )

    fast = interpreted("ninfer.kernels.nvfp4_gemm.triton")

Config = fast.Config
E4M3 = torch.float8_e4m3fn
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10}
interpreter_only = pytest.mark.skipif(ON_GPU, reason="the CPU interpreter runs where no GPU is; the gpu tests cover the kernel")

N = 200
# Few programs per launch keep the interpreter fast: 4 weight tiles of 64 rows, 16-row x tiles,
# 64-wide K steps; group_m 2 puts M = 40's three row tiles in two bands (one partial).
SMALL = Config(block_m=16, block_n=64, block_k=64, num_warps=4, group_m=2)


def _check(out: torch.Tensor, x, packed, block_scale, row_scale, bias=None) -> None:
    exact = exact_product(x, packed, block_scale, row_scale, bias)
    assert out.shape == (x.shape[0], packed.shape[0]) and out.dtype == x.dtype
    assert torch.isfinite(exact).all()  # the test keeps sums in the output dtype's range
    torch.testing.assert_close(out.double(), exact, rtol=ULP[x.dtype] / 2, atol=1e-5 * exact.abs().max().item())


@pytest.fixture
def bf16_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """tl.dot of bf16 operands in the interpreter as on the GPU: the values widened to fp32
    (exact), products and sums in fp32."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        values = (handle.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(values, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


# --- the exactness the kernel relies on, and the reference ------------------------------------


def _every_code_times_every_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 products [254, 16], the e4m3 bytes [254]) for every finite e4m3 scale (NaN is
    0x7F and 0xFF) and every code 0..15."""
    scale_bytes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    scales = scale_bytes.view(E4M3).double()
    values = torch.tensor([*nvfp4_ref.E2M1_VALUES, *(-v for v in nvfp4_ref.E2M1_VALUES)], dtype=torch.float64)
    return scales[:, None] * values[None, :], scale_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_code_times_block_scale_is_exact_in_16_bits(dtype: torch.dtype) -> None:
    products, scale_bytes = _every_code_times_every_scale()
    assert scale_bytes.numel() == 254 and torch.isfinite(products).all()
    # e2m1: 2 significant bits, e4m3: at most 4, so at most 6 (and 6 occur: 1.5 * 1.875);
    # the range fits fp16's normals.
    nonzero = products[products != 0].abs()
    significand = torch.frexp(nonzero).mantissa  # in [0.5, 1)
    assert torch.equal(significand * 2**6, (significand * 2**6).round())
    assert not torch.equal(significand * 2**5, (significand * 2**5).round())
    assert nonzero.min() == 2.0**-10 and nonzero.max() == 6 * 448
    assert torch.equal(products.to(dtype).double(), products)
    assert torch.equal(products.float().to(dtype).double(), products)  # through fp32, as the kernel


def test_ref_is_the_fp32_product_with_the_dequantized_weight() -> None:
    packed, block_scale, row_scale = random_weights(N, 80, seed=1)
    x, bias = random_activations(40, N, 80, torch.bfloat16, seed=1)
    weight = nvfp4_ref.dequantize_nvfp4(packed, block_scale, row_scale)
    expected = (x.float() @ weight.T + bias.float()).to(torch.bfloat16)
    assert torch.equal(ref.nvfp4_matmul(x, packed, block_scale, row_scale, bias), expected)
    assert torch.equal(gemm_op.nvfp4_matmul(x, packed, block_scale, row_scale, bias), expected)  # CPU: the reference
    decode_rows = nvfp4_ref.gemv_nvfp4(x[:3], packed, block_scale, row_scale)
    assert torch.equal(ref.nvfp4_matmul(x[:3], packed, block_scale, row_scale), decode_rows)


def test_linear_routes_rows_above_max_rows_to_the_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nvfp4Linear: the GEMV up to MAX_ROWS rows, nvfp4_matmul above (on the CPU its reference:
    # dequantize, one fp32 matmul), for any leading shape.
    from ninfer.models.quant import nvfp4 as nvfp4_module

    packed, block_scale, row_scale = random_weights(N, 64, seed=3)
    x, bias = random_activations(2 * (MAX_ROWS + 1), N, 64, torch.float32, seed=3)
    layer = nvfp4_module.Nvfp4Linear(packed, block_scale, row_scale, bias)
    calls = []
    for name in ("nvfp4_matmul", "gemv_nvfp4"):
        original = getattr(nvfp4_module, name)
        monkeypatch.setattr(nvfp4_module, name, lambda *args, _f=original, _n=name: calls.append(_n) or _f(*args))
    out = layer(x.view(2, MAX_ROWS + 1, 64))
    assert calls == ["nvfp4_matmul"] and out.shape == (2, MAX_ROWS + 1, N)
    assert torch.equal(out.view(-1, N), ref.nvfp4_matmul(x, packed, block_scale, row_scale, bias))
    # fp32 models compute what the dense path (F.linear of the dequantized weight) did, up to order.
    dense = torch.nn.functional.linear(x, layer.dequantized(torch.float32), bias)
    torch.testing.assert_close(out.view(-1, N), dense, rtol=1e-6, atol=1e-6 * dense.abs().max().item())
    layer(x[:MAX_ROWS])
    assert calls == ["nvfp4_matmul", "gemv_nvfp4"]


# --- the Triton kernel under the CPU interpreter ---------------------------------------------


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_tile_of_every_code_and_scale(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel's tile decode on a [256, 16] tile: row r has scale byte r, its 16 columns codes
    # 0..15; every finite product must come out exact (NaN scale rows are not compared).
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel below, built for the interpreter
    import triton
    import triton.language as tl

    @triton.jit
    def tile(packed_ptr, scale_ptr, out_ptr, DTYPE: tl.constexpr):
        r = tl.arange(0, 256)
        packed = tl.load(packed_ptr + r[:, None, None] * 8 + tl.arange(0, 8)[None, None, :])
        scale = tl.load(scale_ptr + r[:, None])
        w = fast._weight_tile(packed, scale, DTYPE)
        tl.store(out_ptr + r[:, None] * 16 + tl.arange(0, 16)[None, :], w)

    every_code = torch.tensor([(2 * i) | ((2 * i + 1) << 4) for i in range(8)], dtype=torch.uint8)
    packed = every_code.expand(256, 8).contiguous()
    scale = torch.arange(256, dtype=torch.uint8).view(E4M3).view(256, 1)
    out = torch.empty(256, 16, dtype=dtype)
    tile[(1,)](packed, scale, out, tl.bfloat16 if dtype == torch.bfloat16 else tl.float16)
    products, scale_bytes = _every_code_times_every_scale()
    decoded = out[scale_bytes.long()].double()
    assert torch.equal(decoded, products)
    assert torch.equal(torch.signbit(decoded), torch.signbit(products))  # code 8 is -0 (times the scale's sign)


@interpreter_only
@pytest.mark.usefixtures("bf16_dot", "bf16_round_to_nearest_even")
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [80, 256])
@pytest.mark.parametrize("m", [17, 40])
def test_matches_reference(m: int, k: int, dtype: torch.dtype, with_bias: bool) -> None:
    packed, block_scale, row_scale = random_weights(N, k, seed=k + m)
    if dtype == torch.float16:
        row_scale = row_scale * 2**-10
    x, bias = random_activations(m, N, k, dtype, seed=m)
    bias = bias if with_bias else None
    out = fast.nvfp4_matmul(x, packed, block_scale, row_scale, bias, config=SMALL)
    _check(out, x, packed, block_scale, row_scale, bias)


@interpreter_only
@pytest.mark.usefixtures("bf16_dot", "bf16_round_to_nearest_even")
def test_default_config_and_strided_rows() -> None:
    # The heuristic's own launch (40 rows: one 64-row x tile, 64 weight rows, 64-wide steps as
    # K is no multiple of 256, the second step masked), with x, weight and block_scale column
    # slices of wider buffers.
    k = 80
    packed, block_scale, row_scale = random_weights(N, k + 32, seed=7)
    packed, block_scale = packed[:, : k // 2], block_scale[:, : k // nvfp4_ref.BLOCK]
    x, bias = random_activations(40, N, k + 24, torch.bfloat16, seed=7)
    x = x[:, :k]
    assert packed.stride(0) == (k + 32) // 2 and x.stride(0) == k + 24
    assert fast._config(40, N, k, 132) == Config(64, 64, 64, num_warps=4, num_stages=4)
    _check(fast.nvfp4_matmul(x, packed, block_scale, row_scale, bias), x, packed, block_scale, row_scale, bias)


@interpreter_only
@pytest.mark.usefixtures("bf16_round_to_nearest_even")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_gives_the_reference_values_rounded_once(dtype: torch.dtype) -> None:
    # Every code and scale byte at random (zero and subnormal blocks); N and K no tile multiples.
    packed, block_scale, row_scale = random_weights(N, 80, seed=11)
    out = fast.dequantize_nvfp4(packed, block_scale, row_scale, dtype, block_n=32, block_k=32)
    assert out.dtype == dtype and torch.equal(out, nvfp4_ref.dequantize_nvfp4(packed, block_scale, row_scale).to(dtype))


@interpreter_only
@pytest.mark.usefixtures("bf16_round_to_nearest_even")
@pytest.mark.parametrize("k", [48, 2080])
def test_the_default_dequantize_tile_covers_short_and_ragged_rows(k: int) -> None:
    # The default tile (DEQUANTIZE_BLOCK_N rows x up to DEQUANTIZE_BLOCK_K values): shortened to
    # K's power of two on short rows, masked past K on rows longer than one tile.
    packed, block_scale, row_scale = random_weights(N, k, seed=13)
    out = fast.dequantize_nvfp4(packed, block_scale, row_scale, torch.bfloat16)
    assert torch.equal(out, nvfp4_ref.dequantize_nvfp4(packed, block_scale, row_scale).bfloat16())


@interpreter_only
@pytest.mark.usefixtures("bf16_dot", "bf16_round_to_nearest_even")
@pytest.mark.parametrize("with_bias", [False, True])
def test_many_rows_multiply_a_dequantized_copy(with_bias: bool, monkeypatch) -> None:
    # From DEQUANTIZED_MIN_ROWS rows: the product of the weight rounded once to x's dtype (a
    # lower threshold here: the interpreter's in-register kernel below it takes seconds per row tile).
    monkeypatch.setattr(fast, "DEQUANTIZED_MIN_ROWS", 96)
    m, k = fast.DEQUANTIZED_MIN_ROWS, 48
    packed, block_scale, row_scale = random_weights(N, k, seed=12)
    x, bias = random_activations(m, N, k, torch.bfloat16, seed=12)
    bias = bias.bfloat16() if with_bias else None
    dense = nvfp4_ref.dequantize_nvfp4(packed, block_scale, row_scale).bfloat16()
    out = fast.nvfp4_matmul(x, packed, block_scale, row_scale, bias)
    assert torch.equal(out, torch.nn.functional.linear(x, dense, bias))
    exact = exact_product(x, packed, block_scale, row_scale, bias)
    assert ((out.double() - exact).norm() / exact.norm()).item() < 2**-8  # the weight's rounding, averaged
    below = fast.nvfp4_matmul(x[:-1], packed, block_scale, row_scale, bias, config=SMALL)  # the in-register kernel
    _check(below, x[:-1], packed, block_scale, row_scale, bias)


@interpreter_only
def test_fp32_empty_and_invalid_inputs() -> None:
    packed, block_scale, row_scale = random_weights(N, 32, seed=8)
    x, bias = random_activations(20, N, 32, torch.float32, seed=8)
    # fp32 x runs the reference; so does K = 0 (bias only).
    expected = ref.nvfp4_matmul(x, packed, block_scale, row_scale, bias)
    assert torch.equal(fast.nvfp4_matmul(x, packed, block_scale, row_scale, bias), expected)
    x, bias = x.bfloat16(), bias.bfloat16()
    no_k = fast.nvfp4_matmul(x[:, :0], packed[:, :0], block_scale[:, :0], row_scale, bias)
    assert torch.equal(no_k, bias.expand(20, N))
    assert fast.nvfp4_matmul(x[:0], packed, block_scale, row_scale).shape == (0, N)
    assert fast.nvfp4_matmul(x, packed[:0], block_scale[:0], row_scale[:0]).shape == (20, 0)
    with pytest.raises(ValueError, match="multiple of 16"):
        fast.nvfp4_matmul(x[:, :24], packed[:, :12], block_scale[:, :1], row_scale)
    with pytest.raises(ValueError, match="weight"):
        fast.nvfp4_matmul(x, packed.view(torch.int8), block_scale, row_scale)
    with pytest.raises(ValueError, match="block_scale"):
        fast.nvfp4_matmul(x, packed, block_scale.float(), row_scale)
    with pytest.raises(ValueError, match="row_scale"):
        fast.nvfp4_matmul(x, packed, block_scale, row_scale[:-1])
    with pytest.raises(ValueError, match="bias"):
        fast.nvfp4_matmul(x, packed, block_scale, row_scale, bias[:-1])
    with pytest.raises(ValueError, match="config"):
        fast.nvfp4_matmul(x, packed, block_scale, row_scale, config=SMALL._replace(block_k=40))


SHAPES_27B = {  # (N, K) of the 27B projections (ninfer/bench/shapes.py: hidden 5120, intermediate 17408)
    "27b_gdn_in_proj": (16480, 5120),
    "27b_gdn_out_proj": (5120, 6144),
    "27b_attn_qkv": (14336, 5120),
    "27b_mlp_gate_up": (34816, 5120),
    "27b_mlp_down": (5120, 17408),
}


def test_heuristic_on_real_shapes() -> None:
    for n, k in SHAPES_27B.values():
        for m in (17, 64, 65, 512, 1024, 2048, 8192):
            cfg = fast._config(m, n, k, 132)
            assert k % cfg.block_k == 0  # no masked step on the real shapes
            assert cfg.block_n == 64 * (cfg.num_warps // 4)  # 64 weight rows per warpgroup (4 warps)
            assert cfg.block_m >= m or m > 64  # short batches: one row tile
            programs = -(-m // cfg.block_m) * -(-n // cfg.block_n)
            assert cfg.block_m != 256 or (programs >= 2 * 132 and m >= 512)
    assert fast._config(8192, 5120, 17408, 132).block_m == 256
    assert fast._config(1024, 5120, 5120, 132).block_m == 128  # 256-row tiles: 160 programs
    assert fast._config(17, 5120, 5120, 132) == Config(32, 64, 128, num_warps=4, num_stages=4)


# --- compiled on the GPU ---------------------------------------------------------------------


def _exact_fp32(x, packed, block_scale, row_scale, bias=None, dense: torch.dtype = torch.float32) -> torch.Tensor:
    """dense: the dtype the dequantized weight is rounded to first (the many-rows route's copy)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out = x.float() @ nvfp4_ref.dequantize_nvfp4(packed, block_scale, row_scale).to(dense).float().T
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return out if bias is None else out + bias.float()


def _check_gpu(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # Exact products and fp32 sums in both (other orders; the tensor cores' fp32 accumulation
    # may drop low bits on alignment), then one rounding: within half a unit of the output
    # dtype (with margin: a full unit) plus 1e-4 of the largest output for the fp32 sums of
    # 5120-17408 terms near zero.
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, rtol=ULP[dtype], atol=1e-4 * expected.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
class TestOnGpu:
    @pytest.fixture(scope="class")
    def weights(self):
        cache = {}

        def get(name: str):
            if name not in cache:
                cache.clear()  # one shape's weights at a time
                n, k = SHAPES_27B[name]
                w = torch.randn(n, k, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * k**-0.5
                cache[name] = nvfp4_ref.quantize_nvfp4(w)
            return cache[name]

        return get

    @pytest.mark.parametrize("name", ["27b_mlp_gate_up", "27b_mlp_down", "27b_gdn_out_proj"])
    @pytest.mark.parametrize("m", [300, 1024, 8192])
    def test_matches_reference(self, name: str, m: int, weights) -> None:
        n, k = SHAPES_27B[name]
        packed, block_scale, row_scale = weights(name)
        x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).bfloat16()
        out = gemm_op.nvfp4_matmul(x, packed, block_scale, row_scale)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        exact = _exact_fp32(x, packed, block_scale, row_scale)
        if m >= fast.DEQUANTIZED_MIN_ROWS:
            # cuBLAS over the weight rounded once to bf16: exact against that weight, and within
            # its rounding (2^-9 per weight, averaged over K terms) of the NVFP4 weight.
            _check_gpu(out, _exact_fp32(x, packed, block_scale, row_scale, dense=torch.bfloat16), torch.bfloat16)
            assert ((out.float() - exact).norm() / exact.norm()).item() < 2**-8
        else:
            _check_gpu(out, exact, torch.bfloat16)
        # The dispatcher's choice for CUDA tensors, and the same bits on every run.
        assert torch.equal(fast.nvfp4_matmul(x, packed, block_scale, row_scale), out)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("m", [17, 40, 300])
    def test_bias_odd_shapes_and_random_scales(self, dtype: torch.dtype, m: int) -> None:
        # Random codes and scales (zero and subnormal blocks), x rows strided, N and K no tile
        # multiples; row scales cut by 2^-12 to keep fp16 sums in range.
        n, k = 200 + 5120, 80 + 6144
        packed, block_scale, row_scale = random_weights(n, k, seed=m, device="cuda")
        row_scale = row_scale * 2**-12
        gen = torch.Generator("cuda").manual_seed(100 + m)
        x = torch.randn(m, k + 64, device="cuda", generator=gen).to(dtype)[:, :k]
        bias = torch.randn(n, device="cuda", generator=gen).to(dtype)
        out = gemm_op.nvfp4_matmul(x, packed, block_scale, row_scale, bias)
        _check_gpu(out, _exact_fp32(x, packed, block_scale, row_scale, bias), dtype)

    def test_linear_takes_the_gemm_above_max_rows(self, weights, monkeypatch: pytest.MonkeyPatch) -> None:
        from ninfer.models.quant import nvfp4 as nvfp4_module

        packed, block_scale, row_scale = weights("27b_gdn_out_proj")
        layer = nvfp4_module.Nvfp4Linear(packed, block_scale, row_scale, None)
        calls = []
        original = nvfp4_module.nvfp4_matmul
        monkeypatch.setattr(nvfp4_module, "nvfp4_matmul", lambda *args: calls.append(args[0].shape) or original(*args))
        x = torch.randn(2, MAX_ROWS + 1, 6144, device="cuda").bfloat16()
        out = layer(x)
        assert calls == [(2 * (MAX_ROWS + 1), 6144)] and out.shape == (2, MAX_ROWS + 1, 5120)
        assert torch.equal(out.reshape(-1, 5120), fast.nvfp4_matmul(x.reshape(-1, 6144), packed, block_scale, row_scale))
        layer(x[:1, :MAX_ROWS])  # decode sizes: the GEMV
        assert len(calls) == 1

    @pytest.mark.parametrize("m", [64, 4096])  # the in-register kernel; the dequantized copy
    def test_cuda_graph_replay(self, weights, m: int) -> None:
        packed, block_scale, row_scale = weights("27b_mlp_down")
        x = torch.randn(m, 17408, device="cuda").bfloat16()
        eager = fast.nvfp4_matmul(x, packed, block_scale, row_scale)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fast.nvfp4_matmul(x, packed, block_scale, row_scale)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, fast.nvfp4_matmul(x, packed, block_scale, row_scale))
        assert not torch.equal(captured, eager)
