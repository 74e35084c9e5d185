"""The block-scaled FP8 GEMM for prefill: ref.py on the CPU, the Triton kernels against it under
Triton's CPU interpreter, and (marked gpu) compiled on CUDA at the 27B prefill shapes.

Interpreter shapes are small and odd: M = 37 rows (no multiple of a tile, a shorter last
band), N = 200 columns (a partial last column tile), K = 320 (two whole 128-column groups and
a half one, the masked K step). The interpreter is given the GPU's roundings (fp32 -> e4m3
and fp32 -> bf16 round to nearest even), so the quantization is the reference's bytes.

Tolerances of the product against ref.py: e4m3 products are exact in fp32 and both sides sum
each group in fp32, the interpreter (numpy) and the reference (torch) in their own orders:
fp32 outputs agree to ~1e-6 of the largest; bf16 ones are rounded once from such values, so
within one bf16 unit (2^-7 relative). The GPU's tolerances are with its tests, below.

The interpreter module skips itself where a GPU is present, which would take the gpu tests
with it; so this file imports it only on CPU-only machines, and marks which tests need which.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer.bench.shapes import SHAPES
from ninfer.kernels import fp8_gemm as fp8_gemm_op
from ninfer.kernels.fp8_gemm import ref
from ninfer.kernels.fp8_quant.ref import FP8, FP8_MAX, MIN_AMAX, row_scales
from ninfer.kernels.fp8_quant.ref import quantize_rows as quantize_rows_ref
from ninfer.kernels.gemv.ref import MAX_ROWS, SCALE_BLOCK, dequantize
from ninfer.models.quant.fp8 import Fp8Linear, expand_block_rows, quantize_row_blocks

ON_GPU = torch.cuda.is_available()
if ON_GPU:
    pytest.importorskip("triton")
    from ninfer.kernels.fp8_gemm import triton as fast
else:
    from tests.kernels.interpreter import (  # noqa: F401 (autouse and named fixtures)
        bf16_round_to_nearest_even,
        cpu_interpreter,
        fp8e4nv_round_to_nearest_even,
        interpreted,
    )

    fast = interpreted("ninfer.kernels.fp8_gemm.triton")

Config = fast.Config
interpreter_only = pytest.mark.skipif(ON_GPU, reason="the CPU interpreter runs where no GPU is; the gpu tests cover the kernels")
# The interpreter's fp32 -> e4m3 and fp32 -> bf16 conversions made to round as the GPU's (the
# fixtures exist only where the interpreter module was imported).
gpu_roundings = (
    interpreter_only if ON_GPU else pytest.mark.usefixtures("fp8e4nv_round_to_nearest_even", "bf16_round_to_nearest_even")
)

M, N, K = 37, 200, 320
# Small tiles and 2-tile-row bands: 2 x 4 tiles in two bands, the second one tile row short.
SMALL = Config(block_m=32, block_n=64, num_warps=4, num_stages=1, band_m=2)


def _activations(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows and groups of very different magnitudes, an all-zero group and an outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-2, 2, rows)[:, None]
    x *= 4.0 ** torch.randint(-3, 4, (1, cols), generator=gen)  # group-to-group spread
    if rows > 2 and cols > 4:
        x[1, : min(cols, SCALE_BLOCK)] = 0.0  # one all-zero group: the minimum amax
        x[2, cols // 2] = 3e4  # one outlier sets its group's scale
    return x.to(dtype)


def _block_weight(n: int, k: int, seed: int, rows_per_scale: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 codes (every finite magnitude) with positive fp32 block scales spanning 2^-12..2^-4,
    as row blocks [n, ceil(k/128)] (rows_per_scale 1) or 128 x 128 blocks."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    scale_rows = -(-n // rows_per_scale)
    scale = 2.0 ** torch.empty(scale_rows, ref.num_groups(k)).uniform_(-12, -4, generator=gen)
    return weight, scale


def _x_dequantized(x_fp8: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    cols = x_fp8.shape[1]
    return x_fp8.float() * x_scale.float().repeat_interleave(SCALE_BLOCK, dim=1)[:, :cols]


# --- ref.py on the CPU ---------------------------------------------------------------------


def test_group_scales_and_quantization_error() -> None:
    x = _activations(7, 300, torch.float32, seed=0)
    q, scale = ref.quantize_groups(x)
    assert q.dtype == FP8 and q.shape == (7, 300) and scale.dtype == torch.float32 and scale.shape == (7, 3)
    padded = F.pad(x, (0, 84)).view(7, 3, SCALE_BLOCK)
    assert torch.equal(scale, row_scales(padded.abs().amax(dim=-1)))  # amax * fp32(1/448), exactly
    assert scale[1, 0] == row_scales(torch.tensor(MIN_AMAX)) and not q[1, :SCALE_BLOCK].float().any()
    # Each group's largest magnitude maps onto 448 (the zero group aside).
    q_groups = F.pad(q.float(), (0, 84)).view(7, 3, SCALE_BLOCK).abs().amax(dim=-1)
    nonzero = padded.abs().amax(dim=-1) > 0
    assert (q_groups[nonzero] == FP8_MAX).all()
    # Round to nearest on e4m3's grid: half a step, 2^-4 of the value for normals (3 mantissa
    # bits), 2^-10 of the scale for subnormals (steps of 2^-9 below 2^-6), plus fp32 slack.
    scale_per_col = scale.repeat_interleave(SCALE_BLOCK, dim=1)[:, :300]
    error = (q.float() * scale_per_col - x).abs()
    bound = torch.maximum(x.abs() * 2**-4, scale_per_col * 2**-10) * (1 + 1e-5)
    assert (error <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_group_is_fp8_quant_per_row(dtype: torch.dtype) -> None:
    # K <= 128 is one group per row: the same bytes and scales as fp8_quant's per-row reference.
    x = _activations(9, 100, dtype, seed=1)
    q, scale = ref.quantize_groups(x)
    q_rows, scale_rows = quantize_rows_ref(x, row_multiple=1)
    assert torch.equal(scale, scale_rows) and torch.equal(q.view(torch.uint8), q_rows.view(torch.uint8))


@pytest.mark.parametrize("rows_per_scale", [1, SCALE_BLOCK])
def test_ref_product_is_the_dequantized_operands_product(rows_per_scale: int) -> None:
    x_fp8, x_scale = ref.quantize_groups(_activations(M, K, torch.float32, seed=2))
    weight, weight_scale = _block_weight(N, K, seed=2, rows_per_scale=rows_per_scale)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2))
    exact = _x_dequantized(x_fp8, x_scale).double() @ dequantize(weight, weight_scale).double().T + bias.double()
    out = ref.block_fp8_matmul(x_fp8, x_scale, weight, weight_scale, torch.float32, bias)
    assert out.shape == (M, N) and out.dtype == torch.float32
    # fp32 group sums and scalings against float64: a few fp32 units of the largest output.
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    assert torch.equal(ref.block_fp8_matmul(x_fp8, x_scale, weight, weight_scale, torch.bfloat16, bias), out.bfloat16())


def test_row_block_and_128_block_scales_agree() -> None:
    x_fp8, x_scale = ref.quantize_groups(_activations(M, K, torch.bfloat16, seed=3))
    weight, blocks = _block_weight(N, K, seed=3, rows_per_scale=SCALE_BLOCK)
    row_blocks = expand_block_rows(blocks, N)  # the loader's layout
    assert row_blocks.shape == (N, 3) and blocks.shape == (2, 3)
    want = ref.block_fp8_matmul(x_fp8, x_scale, weight, blocks, torch.float32)
    assert torch.equal(ref.block_fp8_matmul(x_fp8, x_scale, weight, row_blocks, torch.float32), want)


def test_fp8_linear_reference_and_cpu_dispatch() -> None:
    x = _activations(M, K, torch.bfloat16, seed=4)
    weight, weight_scale = quantize_row_blocks(torch.randn(N, K, generator=torch.Generator().manual_seed(4)))
    out = ref.fp8_linear(x, weight, weight_scale)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    assert torch.equal(out, ref.block_fp8_matmul(*ref.quantize_groups(x), weight, weight_scale, torch.bfloat16))
    assert torch.equal(fp8_gemm_op.fp8_linear(x, weight, weight_scale), out)  # CPU tensors: the reference
    # Against the unquantized activations: x's e4m3 rounding (at most 2^-4 of each value).
    exact = x.double() @ dequantize(weight, weight_scale).double().T
    error = (out.double() - exact).abs().max().item()
    assert error <= 2**-4 * (x.double().abs() @ dequantize(weight, weight_scale).double().abs().T).max().item()


def test_ref_rejects_bad_shapes() -> None:
    x_fp8, x_scale = ref.quantize_groups(torch.randn(3, K))
    weight, weight_scale = _block_weight(N, K, seed=5, rows_per_scale=1)
    with pytest.raises(ValueError, match="weight_scale"):
        ref.block_fp8_matmul(x_fp8, x_scale, weight, weight_scale[:, :2], torch.float32)
    with pytest.raises(ValueError, match="x_scale"):
        ref.block_fp8_matmul(x_fp8, x_scale[:, :2], weight, weight_scale, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        ref.block_fp8_matmul(x_fp8, x_scale, weight[:, :256], weight_scale, torch.float32)
    with pytest.raises(ValueError, match="float8"):
        ref.block_fp8_matmul(x_fp8.float(), x_scale, weight, weight_scale, torch.float32)


# --- the Triton kernels under the CPU interpreter --------------------------------------------


def _check(out: torch.Tensor, want: torch.Tensor) -> None:
    assert out.shape == want.shape and out.dtype == want.dtype
    rtol = 2**-7 if want.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), want.float(), rtol=rtol, atol=1e-6 * want.float().abs().max().item())


@interpreter_only
@gpu_roundings
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows, cols", [(1, 5), (M, K), (3, 1100), (5, 2048)])
def test_quantize_groups_matches_reference(rows: int, cols: int, dtype: torch.dtype) -> None:
    x = _activations(rows, cols, dtype, seed=rows * cols)
    q, scale = fast.quantize_groups(x)
    q_ref, scale_ref = ref.quantize_groups(x)
    assert q.shape == q_ref.shape and scale.shape == scale_ref.shape and scale.stride() == (1, rows)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@interpreter_only
@gpu_roundings
def test_quantize_groups_strided_and_empty() -> None:
    x = _activations(M, K + 60, torch.bfloat16, seed=6)[:, 30 : 30 + K]
    assert x.stride(0) == K + 60
    q, scale = fast.quantize_groups(x)
    q_ref, scale_ref = ref.quantize_groups(x)
    assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert [t.shape for t in fast.quantize_groups(x[:0])] == [(0, K), (0, 3)]
    assert [t.shape for t in fast.quantize_groups(x[:, :0])] == [(M, 0), (M, 0)]
    with pytest.raises(ValueError):
        fast.quantize_groups(torch.zeros(2, 3, 4))


@interpreter_only
@gpu_roundings
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows_per_scale", [1, SCALE_BLOCK])
def test_matmul_matches_reference(rows_per_scale: int, out_dtype: torch.dtype, with_bias: bool) -> None:
    x_fp8, x_scale = ref.quantize_groups(_activations(M, K, torch.bfloat16, seed=7))
    weight, weight_scale = _block_weight(N, K, seed=7, rows_per_scale=rows_per_scale)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(7)).to(out_dtype) if with_bias else None
    want = ref.block_fp8_matmul(x_fp8, x_scale, weight, weight_scale, out_dtype, bias)
    _check(fast.block_fp8_matmul(x_fp8, x_scale, weight, weight_scale, out_dtype, bias, config=SMALL), want)


@interpreter_only
@gpu_roundings
def test_default_config_even_k_and_strided_operands() -> None:
    # The heuristic's own launch (64 x 64 tiles at this size); K = 256 takes the unmasked loop.
    # x and the weight as column slices of wider buffers, the scales transposed views.
    k = 256
    x_fp8, x_scale = ref.quantize_groups(_activations(M, k + 128, torch.bfloat16, seed=8))
    weight, weight_scale = _block_weight(N, k + 128, seed=8, rows_per_scale=1)
    x_fp8, x_scale, weight, weight_scale = x_fp8[:, :k], x_scale[:, :2], weight[:, :k], weight_scale[:, :2]
    x_scale_t = x_scale.t().contiguous().t()
    assert fast._config(M, N, 132) == fast.TILES[-1]
    want = ref.block_fp8_matmul(x_fp8, x_scale, weight, weight_scale, torch.bfloat16)
    _check(fast.block_fp8_matmul(x_fp8, x_scale_t, weight, weight_scale, torch.bfloat16), want)


@interpreter_only
@gpu_roundings
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_matches_reference(dtype: torch.dtype) -> None:
    x = _activations(M, K, dtype, seed=9)
    weight, weight_scale = quantize_row_blocks(torch.randn(N, K, generator=torch.Generator().manual_seed(9)))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(9)).to(dtype)
    _check(fast.fp8_linear(x, weight, weight_scale, bias, config=SMALL), ref.fp8_linear(x, weight, weight_scale, bias))


@interpreter_only
@gpu_roundings
def test_one_partial_group_and_empty_shapes() -> None:
    # K = 100: the only group is partial; one row, N = 17: one tile mostly past the matrix.
    x = _activations(1, 100, torch.bfloat16, seed=10)
    weight, weight_scale = _block_weight(17, 100, seed=10, rows_per_scale=1)
    _check(fast.fp8_linear(x, weight, weight_scale), ref.fp8_linear(x, weight, weight_scale))
    bias = torch.randn(17).bfloat16()
    assert fast.fp8_linear(x[:0], weight, weight_scale).shape == (0, 17)
    assert fast.fp8_linear(x, weight[:0], weight_scale[:0]).shape == (1, 0)
    no_k = fast.fp8_linear(x[:, :0], weight[:, :0], weight_scale[:, :0], bias)
    assert torch.equal(no_k, bias[None, :])


@interpreter_only
def test_rejects_bad_inputs() -> None:
    x_fp8, x_scale = ref.quantize_groups(torch.randn(3, K))
    weight, weight_scale = _block_weight(N, K, seed=11, rows_per_scale=1)
    with pytest.raises(ValueError, match="weight_scale"):
        fast.block_fp8_matmul(x_fp8, x_scale, weight, weight_scale[:-1], torch.float32)
    with pytest.raises(ValueError, match="x_scale"):
        fast.block_fp8_matmul(x_fp8, x_scale[:, :2], weight, weight_scale, torch.float32)
    with pytest.raises(ValueError, match="bias"):
        fast.block_fp8_matmul(x_fp8, x_scale, weight, weight_scale, torch.float32, torch.zeros(N + 1))
    with pytest.raises(ValueError, match="config"):
        fast.block_fp8_matmul(x_fp8, x_scale, weight, weight_scale, torch.float32, config=Config(8, 64, 4, 1))


def _projections_27b() -> dict[str, tuple[int, int]]:
    """(N, K) of the 27B's FP8 projections, from the bench shape (ninfer/bench/shapes.py)."""
    c = SHAPES["27b"]
    hidden, head = c["hidden_size"], c["head_dim"]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value_dim = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    return {
        # q with its output gate, k, v
        "attn_qkv": (2 * c["num_attention_heads"] * head + 2 * c["num_key_value_heads"] * head, hidden),
        # q, k, v, z, b, a
        "gdn_in_proj": (2 * key_dim + 2 * value_dim + 2 * c["linear_num_value_heads"], hidden),
        "gdn_out_proj": (hidden, value_dim),
        "mlp_gate_up": (2 * c["intermediate_size"], hidden),
        "mlp_down": (hidden, c["intermediate_size"]),
    }


PROJECTIONS_27B = _projections_27b()


def test_heuristic_on_real_shapes() -> None:
    assert PROJECTIONS_27B["mlp_gate_up"] == (34816, 5120) and PROJECTIONS_27B["attn_qkv"] == (14336, 5120)
    assert PROJECTIONS_27B["gdn_in_proj"] == (16480, 5120) and PROJECTIONS_27B["mlp_down"] == (5120, 17408)
    for n, _ in PROJECTIONS_27B.values():
        assert fast._config(1024, n, 132) == fast._config(8192, n, 132) == Config(64, 128, 4, 4)
        assert fast._config(MAX_ROWS + 1, n, 132).block_m == 64  # decode batches past the GEMV
    assert fast._config(MAX_ROWS + 1, 5120, 132) == Config(64, 64, 4, 4)  # 80 tiles: the smallest


# --- compiled on the GPU ---------------------------------------------------------------------


def _qwen_like_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint-like weight on the GPU: Gaussian rows of different magnitudes, quantized
    per 128 x 128 block; returned with the loader's row-block scales."""
    gen = torch.Generator("cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
    w *= torch.rand(n, 1, device="cuda", generator=gen) + 0.5
    blocks_n, blocks_k = -(-n // SCALE_BLOCK), ref.num_groups(k)
    padded = F.pad(w, (0, blocks_k * SCALE_BLOCK - k, 0, blocks_n * SCALE_BLOCK - n))
    tiles = padded.view(blocks_n, SCALE_BLOCK, blocks_k, SCALE_BLOCK)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    quantized = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(padded)[:n, :k].to(FP8)
    return quantized.contiguous(), expand_block_rows(scale, n)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
class TestOnGpu:
    @pytest.fixture(scope="class")
    def weights(self):
        cache = {}

        def get(name: str):
            if name not in cache:
                cache.clear()  # one shape's weights at a time
                cache[name] = _qwen_like_weight(*PROJECTIONS_27B[name], seed=len(name))
            return cache[name]

        return get

    def test_dispatch_takes_the_triton_kernels(self) -> None:
        from ninfer.kernels.backend import fast_impl

        for name in ("quantize_groups", "block_fp8_matmul", "fp8_linear"):
            assert fast_impl("ninfer.kernels.fp8_gemm", name, torch.zeros(1, device="cuda")) is not None

    @pytest.mark.parametrize("name", list(PROJECTIONS_27B))
    @pytest.mark.parametrize("m", [1024, 8192])
    def test_real_prefill_shapes(self, name: str, m: int, weights) -> None:
        n, k = PROJECTIONS_27B[name]
        weight, weight_scale = weights(name)
        x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).bfloat16()
        out = fp8_gemm_op.fp8_linear(x, weight, weight_scale)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        # The quantization is the reference's, bit for bit.
        x_fp8, x_scale = fast.quantize_groups(x)
        x_fp8_ref, x_scale_ref = ref.quantize_groups(x)
        assert torch.equal(x_scale, x_scale_ref) and torch.equal(x_fp8.view(torch.uint8), x_fp8_ref.view(torch.uint8))
        # Against the reference product of the same operands: both round once to bf16 (2^-7
        # relative) from fp32 sums; inside each 128-column group the tensor cores accumulate
        # with fewer bits than fp32, which atol (2^-8 of the largest output) covers with margin.
        want = ref.block_fp8_matmul(x_fp8_ref, x_scale_ref, weight, weight_scale, torch.float32)
        torch.testing.assert_close(out.float(), want, rtol=2**-7, atol=2**-8 * want.abs().max().item())
        del want
        # Against the bf16 product of the unquantized activations and the dequantized weight
        # (the path this replaces): x's e4m3 rounding, at most 2^-4 of each value, random in
        # sign: at most 2^-3 of the largest output, and an RMS error under 2^-4 of the outputs' RMS.
        linear = F.linear(x, dequantize(weight, weight_scale).bfloat16()).float()
        error = out.float() - linear
        assert error.abs().max().item() <= 2**-3 * linear.abs().max().item()
        assert error.pow(2).mean().sqrt().item() <= 2**-4 * linear.pow(2).mean().sqrt().item()
        # The same bits on every run.
        assert torch.equal(fp8_gemm_op.fp8_linear(x, weight, weight_scale), out)

    @pytest.mark.parametrize("m", [MAX_ROWS + 1, 300])
    def test_bias_128_blocks_and_small_batches(self, m: int) -> None:
        # 128 x 128 scales and a bias at gdn_out_proj's shape, odd row counts, fp32 output.
        n, k = PROJECTIONS_27B["gdn_out_proj"]
        weight, row_blocks = _qwen_like_weight(n, k, seed=m)
        blocks = row_blocks[::SCALE_BLOCK].contiguous()
        gen = torch.Generator("cuda").manual_seed(m)
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
        x_fp8, x_scale = fast.quantize_groups(x)
        want = ref.block_fp8_matmul(x_fp8, x_scale, weight, row_blocks, torch.float32, bias)
        for scale in (row_blocks, blocks):
            out = fast.block_fp8_matmul(x_fp8, x_scale, weight, scale, torch.float32, bias)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=2**-8 * want.abs().max().item())

    def test_fp8_linear_module_takes_the_block_scaled_gemm(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import ninfer.models.quant.fp8 as fp8_module

        n, k = 1024, 640
        weight, weight_scale = _qwen_like_weight(n, k, seed=12)
        bias = torch.randn(n, device="cuda").bfloat16()
        layer = Fp8Linear(weight, weight_scale, bias)
        calls = []

        def counted(*args, **kwargs):
            calls.append(args[0].shape)
            return fp8_gemm_op.fp8_linear(*args, **kwargs)

        def no_dequantize(*args, **kwargs):
            raise AssertionError("the block-scaled prefill path dequantized the weight")

        monkeypatch.setattr(fp8_module, "fp8_linear", counted)
        monkeypatch.setattr(fp8_module, "dequantize", no_dequantize)
        x = torch.randn(2, 150, k, device="cuda").bfloat16()
        want = ref.fp8_linear(x.view(-1, k), weight, weight_scale, bias).float()
        out = layer(x)
        assert out.shape == (2, 150, n) and calls == [(300, k)]
        torch.testing.assert_close(out.view(-1, n).float(), want, rtol=2**-7, atol=2**-8 * want.abs().max().item())
        gated = layer.forward_silu_and_mul(x)  # gate | up halves of the same product
        assert gated.shape == (2, 150, n // 2) and len(calls) == 2
        assert torch.equal(gated, fp8_module.silu_and_mul(out))

    def test_cuda_graph_replay(self, weights) -> None:
        weight, weight_scale = weights("gdn_out_proj")
        x = torch.randn(64, weight.shape[1], device="cuda").bfloat16()
        eager = fp8_gemm_op.fp8_linear(x, weight, weight_scale)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fp8_gemm_op.fp8_linear(x, weight, weight_scale)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, fp8_gemm_op.fp8_linear(x, weight, weight_scale))
        assert not torch.equal(captured, eager)
