"""NVFP4 routed experts (ModelOpt's layout): ref.fused_experts with e2m1 codes on the CPU, our
Triton MoE kernels against it under Triton's CPU interpreter, and (marked gpu) compiled at the
35B-A3B shapes.

Interpreter shapes: H = 208 (13 scale blocks: a partial second K step of 128), I = 80 (5
blocks; the down projection's only K step is partial). The interpreter has no bf16 dot, so x
is fp32 or fp16; bf16 runs on the GPU. A code's value times its block scale is exact in 16
bits (kernels/nvfp4_gemm), so fp32 x sums the reference's exact products in another order
(1e-5 relative) and the row scale is applied after the sum instead of before it.

The interpreter module skips itself where a GPU is present, which would take the gpu tests
with it; so this file imports it only on CPU-only machines.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.bench.shapes import SHAPES
from ninfer.kernels.moe import fused_experts, ref
from ninfer.kernels.nvfp4_gemv.ref import dequantize_nvfp4
from tests.kernels.moe_cases import relative_error, routed

ON_GPU = torch.cuda.is_available()
if ON_GPU:
    pytest.importorskip("triton")
    from ninfer.kernels.moe import triton as fast
else:
    from tests.kernels.interpreter import bf16_round_to_nearest_even, cpu_interpreter, interpreted  # noqa: F401 (fixtures)

    fast = interpreted("ninfer.kernels.moe.triton")

interpreter_only = pytest.mark.skipif(ON_GPU, reason="the CPU interpreter runs where no GPU is; the gpu tests cover the kernels")


def _nvfp4_experts(num_experts: int, rows: int, cols: int, gen: torch.Generator, device: str = "cpu"):
    """Random N(0, 1/cols) expert weights, quantized -> (codes [E, N, K/2], (block_scale, row_scale))."""
    return ref.quantize_nvfp4_experts((torch.randn(num_experts, rows, cols, generator=gen) * cols**-0.5).to(device))


def _experts(num_experts: int, hidden: int, inter: int, seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    gate_up, gate_up_scale = _nvfp4_experts(num_experts, 2 * inter, hidden, gen, device)
    down, down_scale = _nvfp4_experts(num_experts, hidden, inter, gen, device)
    return gate_up, gate_up_scale, down, down_scale


def _dequantized(codes: torch.Tensor, scale: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.stack([dequantize_nvfp4(codes[e], scale[0][e], scale[1][e]) for e in range(codes.shape[0])])




# ---- the reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_ref_equals_the_unquantized_reference_on_dequantized_weights(num_tokens: int) -> None:
    gate_up, gate_up_scale, down, down_scale = _experts(8, 256, 128, seed=num_tokens)
    x, weights, ids = routed(num_tokens, 256, 8, 2, seed=num_tokens)
    out = ref.fused_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale)
    expected = ref.fused_experts(x, weights, ids, _dequantized(gate_up, gate_up_scale), _dequantized(down, down_scale))
    assert torch.equal(out, expected)  # fp32 x: the same fp32 products and sums
    dequantized = ref.dequantize_experts(gate_up, gate_up_scale, torch.float32)
    assert torch.equal(dequantized, _dequantized(gate_up, gate_up_scale))


# ---- Triton under the interpreter ---------------------------------------------------------------

NUM_EXPERTS, HIDDEN, INTER, TOP_K = 8, 208, 80, 4


@interpreter_only
@pytest.mark.parametrize("num_tokens", [1, 2, 40])  # 4 and 8 pairs: decode kernels; 160 pairs: sorted (prefill)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_match_reference(num_tokens: int, dtype: torch.dtype) -> None:
    gate_up, gate_up_scale, down, down_scale = _experts(NUM_EXPERTS, HIDDEN, INTER, seed=num_tokens)
    x, weights, ids = routed(num_tokens, HIDDEN, NUM_EXPERTS, TOP_K, seed=10 + num_tokens)
    out = fast.fused_experts(x.to(dtype), weights.to(dtype), ids, gate_up, down, gate_up_scale, down_scale)
    expected = ref.fused_experts(
        x.double(), weights.double(), ids, _dequantized(gate_up, gate_up_scale).double(), _dequantized(down, down_scale).double()
    )
    assert out.dtype == dtype and out.shape == x.shape
    # fp16 rounds the activation and each weighted expert output once (2^-11 relative each)
    assert relative_error(out, expected) < (1e-5 if dtype == torch.float32 else 2e-3)


@interpreter_only
@pytest.mark.parametrize("block_m", [16, 64])
def test_prefill_blocks_and_an_expert_serving_every_token(block_m: int) -> None:
    """Sorted blocks of 16 and 64 rows; expert 3 is in every token's top k (full groups), expert 0 in none."""
    gate_up, gate_up_scale, down, down_scale = _experts(NUM_EXPERTS, HIDDEN, INTER, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(50, HIDDEN, generator=gen)
    logits = torch.randn(50, NUM_EXPERTS, generator=gen)
    logits[:, 0] -= 100
    logits[:, 3] += 100
    weights, ids = ref.route(logits, TOP_K, True)
    out = fast.fused_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale, block_m=block_m)
    expected = ref.fused_experts(x.double(), weights.double(), ids, gate_up, down, gate_up_scale, down_scale)
    assert relative_error(out, expected) < 1e-5


@interpreter_only
def test_kernels_reject_mismatched_experts() -> None:
    gate_up, (gate_up_block, gate_up_row), down, down_scale = _experts(NUM_EXPERTS, HIDDEN, INTER, seed=7)
    x, weights, ids = routed(2, HIDDEN, NUM_EXPERTS, TOP_K, seed=7)
    with pytest.raises(ValueError, match="both scales"):
        fast.fused_experts(x, weights, ids, gate_up, down, (gate_up_block, gate_up_row))
    with pytest.raises(ValueError, match="block_scale must be float8_e4m3fn"):
        fast.fused_experts(x, weights, ids, gate_up, down, (gate_up_block[:, :, 1:], gate_up_row), down_scale)
    with pytest.raises(ValueError, match="row_scale must be float32"):
        fast.fused_experts(x, weights, ids, gate_up, down, (gate_up_block, gate_up_row[:, 1:]), down_scale)
    with pytest.raises(ValueError, match="pair"):
        fast.fused_experts(x, weights, ids, gate_up, down, gate_up_row, down_scale)
    with pytest.raises(ValueError, match="whole 16-code scale blocks"):
        fast.fused_experts(
            x, weights, ids, gate_up, down, (gate_up_block, gate_up_row), down_scale, tiles=((32, 8, 4, 1), (32, 128, 4, 1))
        )


@interpreter_only
@pytest.mark.usefixtures("bf16_round_to_nearest_even")  # the GPU's conversion, not the interpreter's
def test_dequantize_experts_gives_the_reference_bits() -> None:
    """The one-pass dequantization the NVFP4 prefill hands to the grouped GEMM: one fp32 product, rounded once."""
    gen = torch.Generator().manual_seed(3)
    codes, scale = _nvfp4_experts(3, 200, 144, gen)  # a partial row tile and a partial 128-column tile
    for dtype in (torch.float32, torch.bfloat16):
        out = fast.dequantize_experts(codes, scale, dtype, block_n=32, block_k=64)
        assert out.dtype == dtype and torch.equal(out, ref.dequantize_experts(codes, scale, dtype))
    # The default tile: every row's 144 values in one program of 8 rows.
    assert torch.equal(fast.dequantize_experts(codes, scale, torch.bfloat16), ref.dequantize_experts(codes, scale, torch.bfloat16))


def test_launches_compile_for_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each NVFP4 expert launch (decode and sorted grouping) and the dequantization, recorded, not
    run, and compiled for sm_90: code only Triton's compiler rejects passes the interpreter."""
    from triton.runtime.jit import JITFunction

    from tests.kernels.test_pdl_launch import _ptx, compiled_kernel_module

    compiled = compiled_kernel_module(monkeypatch, "ninfer.kernels.moe.triton")
    recorded: list = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kwargs: recorded.append((self, args, kwargs)))
    gate_up, gate_up_scale, down, down_scale = _experts(NUM_EXPERTS, 256, 128, seed=8)
    for num_tokens in (2, 40):
        x, weights, ids = routed(num_tokens, 256, NUM_EXPERTS, TOP_K, seed=8)
        compiled.fused_experts(x.bfloat16(), weights.bfloat16(), ids, gate_up, down, gate_up_scale, down_scale, grouped_mm=False)
    compiled.dequantize_experts(gate_up, gate_up_scale, torch.bfloat16)
    launches = [(fn, args, kwargs) for fn, args, kwargs in recorded if fn.fn.__name__ != "_combine_kernel"]
    assert [fn.fn.__name__ for fn, _, _ in launches] == ["_moe_up_kernel", "_moe_down_kernel"] * 2 + [
        "_dequantize_kernel"
    ]
    for fn, args, kwargs in launches[:4]:
        assert "mma" in _ptx(fn, args, kwargs)
    assert _ptx(*launches[4])


# ---- compiled on the GPU ------------------------------------------------------------------------

_35B = SHAPES["35b-a3b"]
E_35B, TOP_K_35B = _35B["num_experts"], _35B["num_experts_per_tok"]
HIDDEN_35B, INTER_35B = _35B["hidden_size"], _35B["moe_intermediate_size"]
EXPERTS_REL = 1e-2  # bf16 activations and outputs, fp32 sums


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
class TestOnGpu:
    @pytest.fixture(scope="class")
    def experts(self) -> tuple[torch.Tensor, ...]:
        return _experts(E_35B, HIDDEN_35B, INTER_35B, seed=0, device="cuda")

    def _routed(self, num_tokens: int, seed: int):
        x, weights, ids = routed(num_tokens, HIDDEN_35B, E_35B, TOP_K_35B, seed, device="cuda")
        return x.bfloat16(), weights.bfloat16(), ids

    def _exact(self, x, weights, ids, experts) -> torch.Tensor:
        gate_up, gate_up_scale, down, down_scale = experts
        return ref.fused_experts(
            x.double(), weights.double(), ids,
            _dequantized(gate_up, gate_up_scale).double(), _dequantized(down, down_scale).double(),
        )  # fmt: skip

    # 1..8: decode kernels (<= 128 pairs); 17, 300: sorted; 8192: dequantized onto the grouped GEMM
    @pytest.mark.parametrize("num_tokens", [1, 2, 8, 17, 300, 8192])
    def test_matches_float64(self, num_tokens: int, experts) -> None:
        gate_up, gate_up_scale, down, down_scale = experts
        x, weights, ids = self._routed(num_tokens, seed=100 + num_tokens)
        out = fused_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale)  # the dispatched op
        exact = self._exact(x, weights, ids, experts)
        nvfp4_ref = ref.fused_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale)
        err, ref_err = relative_error(out, exact), relative_error(nvfp4_ref, exact)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        assert err < EXPERTS_REL
        assert err <= ref_err * 1.5  # no worse than the reference's bf16 roundings

    def test_triton_prefill_matches_float64(self, experts) -> None:
        gate_up, gate_up_scale, down, down_scale = experts
        x, weights, ids = self._routed(2048, seed=400)
        out = fast.fused_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale, grouped_mm=False)
        assert relative_error(out, self._exact(x, weights, ids, experts)) < EXPERTS_REL

    def test_dequantize_experts_gives_the_reference_bits(self, experts) -> None:
        gate_up, gate_up_scale, down, down_scale = experts
        for weight, scale in ((gate_up, gate_up_scale), (down, down_scale)):
            out = fast.dequantize_experts(weight, scale, torch.bfloat16)
            assert torch.equal(out, ref.dequantize_experts(weight, scale, torch.bfloat16))

    def test_decode_replays_from_a_cuda_graph(self, experts) -> None:
        gate_up, gate_up_scale, down, down_scale = experts
        x, weights, ids = self._routed(2, seed=300)
        fast.fused_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale)  # compile outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fast.fused_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale)
        new_x, new_weights, new_ids = self._routed(2, seed=301)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        assert torch.equal(out, fast.fused_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale))
