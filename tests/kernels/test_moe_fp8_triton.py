"""FP8 routed experts: ref.fused_experts with e4m3 weights on the CPU, our Triton MoE kernels
against it under Triton's CPU interpreter, and (marked gpu) compiled at the 35B-A3B shapes.

Scale layouts (ref.py): per output row, 128 x 128 blocks (Qwen's checkpoints) and row blocks
(per-expert checkpoints whose gate and up blocks do not line up once fused).

Interpreter shapes: H = 200 (a partial second 128-column K block, a partial scale-row block
of the down projection), I = 96 (up rows straddle the gate's 128-row block; the down K is one
partial block). The interpreter has no bf16 dot, so x is fp32 (widened by the fp32 bit moves)
or fp16; bf16 runs on the GPU. Tolerances: fp32 x sums the same exact products as the
float64 reference, in another order (1e-5 relative); fp16 rounds the activation and each
expert output once to fp16 (2^-11 relative each).

The interpreter module skips itself where a GPU is present, which would take the gpu tests
with it; so this file imports it only on CPU-only machines.
"""

from __future__ import annotations

import math

import pytest
import torch

from ninfer.bench.shapes import SHAPES
from ninfer.kernels.gemv.ref import SCALE_BLOCK
from ninfer.kernels.moe import fused_experts, ref
from tests.kernels.moe_cases import relative_error, routed

ON_GPU = torch.cuda.is_available()
if ON_GPU:
    pytest.importorskip("triton")
    from ninfer.kernels.moe import triton as fast
else:
    from tests.kernels.interpreter import bf16_round_to_nearest_even, cpu_interpreter, interpreted  # noqa: F401 (fixtures)

    fast = interpreted("ninfer.kernels.moe.triton")

interpreter_only = pytest.mark.skipif(ON_GPU, reason="the CPU interpreter runs where no GPU is; the gpu tests cover the kernels")
FP8 = torch.float8_e4m3fn
LAYOUTS = {"row": None, "block": SCALE_BLOCK, "row_block": 1}  # name -> weight rows per scale row


def _fp8_weight(
    num_experts: int, rows: int, cols: int, rows_per_block: int | None, gen: torch.Generator, power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes over the whole finite range and fp32 scales that make the weights ~N(0, 1/cols)
    times a factor in [1/2, 2) per scale; power_of_two: scales exact powers of two."""
    codes = (torch.randn(num_experts, rows, cols, generator=gen) * 64).clamp(-448, 448).to(FP8)
    scale_rows = rows if rows_per_block is None else -(-rows // rows_per_block)
    shape = (num_experts, rows) if rows_per_block is None else (num_experts, scale_rows, -(-cols // SCALE_BLOCK))
    exponent = torch.empty(shape).uniform_(-1, 1, generator=gen) + math.log2(cols**-0.5 / 64)
    return codes, 2.0 ** (exponent.round() if power_of_two else exponent)


def _dequantized(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 weights, written out from the layouts' definitions (not through gemv.ref.dequantize)."""
    num_experts, rows, cols = codes.shape
    if scale.dim() == 2:
        return codes.float() * scale[:, :, None]
    rows_per_block = 1 if scale.shape[1] == rows else SCALE_BLOCK
    per_row = scale.repeat_interleave(rows_per_block, dim=1)[:, :rows]
    return codes.float() * per_row.repeat_interleave(SCALE_BLOCK, dim=2)[:, :, :cols]


def _experts(num_experts: int, hidden: int, inter: int, layout: str, seed: int, power_of_two: bool = False):
    gen = torch.Generator().manual_seed(seed)
    gate_up, gate_up_scale = _fp8_weight(num_experts, 2 * inter, hidden, LAYOUTS[layout], gen, power_of_two)
    down, down_scale = _fp8_weight(num_experts, hidden, inter, LAYOUTS[layout], gen, power_of_two)
    return gate_up, gate_up_scale, down, down_scale




# ---- the reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_ref_equals_the_unquantized_reference_on_dequantized_weights(layout: str, num_tokens: int) -> None:
    gate_up, gate_up_scale, down, down_scale = _experts(8, 256, 128, layout, seed=num_tokens)
    x, weights, ids = routed(num_tokens, 256, 8, 2, seed=num_tokens)
    out = ref.fused_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale)
    expected = ref.fused_experts(x, weights, ids, _dequantized(gate_up, gate_up_scale), _dequantized(down, down_scale))
    assert torch.equal(out, expected)  # fp32 x: the same fp32 products and sums
    # bf16 x: the products in fp32, rounded to bf16 where the bf16 path rounds (~2^-9 each)
    out_bf16 = ref.fused_experts(x.bfloat16(), weights.bfloat16(), ids, gate_up, down, gate_up_scale, down_scale)
    assert out_bf16.dtype == torch.bfloat16
    assert relative_error(out_bf16, expected) < 1e-2


def test_ref_rejects_scales_of_no_layout() -> None:
    gate_up, gate_up_scale, down, down_scale = _experts(4, 256, 128, "block", seed=0)
    x, weights, ids = routed(3, 256, 4, 2, seed=0)
    with pytest.raises(ValueError, match="fits no block layout"):
        ref.fused_experts(x, weights, ids, gate_up, down, gate_up_scale[:, :1, :1], down_scale)


# ---- Triton under the interpreter ---------------------------------------------------------------

NUM_EXPERTS, HIDDEN, INTER, TOP_K = 8, 200, 96, 4


@interpreter_only
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("num_tokens", [1, 2, 40])  # 4 and 8 pairs: decode kernels; 160 pairs: sorted (prefill)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_match_reference(layout: str, num_tokens: int, dtype: torch.dtype) -> None:
    gate_up, gate_up_scale, down, down_scale = _experts(NUM_EXPERTS, HIDDEN, INTER, layout, seed=num_tokens)
    x, weights, ids = routed(num_tokens, HIDDEN, NUM_EXPERTS, TOP_K, seed=10 + num_tokens)
    out = fast.fused_experts(x.to(dtype), weights.to(dtype), ids, gate_up, down, gate_up_scale, down_scale)
    expected = ref.fused_experts(x.double(), weights.double(), ids, gate_up, down, gate_up_scale, down_scale)
    assert out.dtype == dtype and out.shape == x.shape
    assert relative_error(out, expected) < (1e-5 if dtype == torch.float32 else 2e-3)


@interpreter_only
@pytest.mark.parametrize("block_m", [16, 64])
def test_prefill_blocks_and_an_expert_serving_every_token(block_m: int) -> None:
    """Sorted blocks of 16 and 64 rows; expert 3 is in every token's top k (full groups), expert 0 in none."""
    gate_up, gate_up_scale, down, down_scale = _experts(NUM_EXPERTS, HIDDEN, INTER, "block", seed=5)
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
    gate_up, gate_up_scale, down, down_scale = _experts(NUM_EXPERTS, HIDDEN, INTER, "block", seed=7)
    x, weights, ids = routed(2, HIDDEN, NUM_EXPERTS, TOP_K, seed=7)
    with pytest.raises(ValueError, match="both scales"):
        fast.fused_experts(x, weights, ids, gate_up, down, gate_up_scale)
    with pytest.raises(ValueError, match="fit no layout"):
        fast.fused_experts(x, weights, ids, gate_up, down, gate_up_scale[:, :1], down_scale)
    with pytest.raises(ValueError, match="divides 128"):
        fast.fused_experts(
            x, weights, ids, gate_up, down, gate_up_scale, down_scale, tiles=((32, 256, 4, 1), (32, 128, 4, 1))
        )


@pytest.mark.parametrize("layout", ["bf16", "row", "block"])
def test_launches_compile_for_sm90(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter runs Python, so code only Triton's compiler rejects passes it: each expert
    launch (decode and sorted grouping; FP8, and bf16 through the same helpers) is recorded, not
    run, and compiled for sm_90."""
    from triton.runtime.jit import JITFunction

    from tests.kernels.test_pdl_launch import _ptx, compiled_kernel_module

    compiled = compiled_kernel_module(monkeypatch, "ninfer.kernels.moe.triton")
    recorded: list = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kwargs: recorded.append((self, args, kwargs)))
    gate_up, gate_up_scale, down, down_scale = _experts(NUM_EXPERTS, 256, 128, "row" if layout == "bf16" else layout, seed=8)
    experts = (gate_up, down, gate_up_scale, down_scale)
    if layout == "bf16":
        experts = (_dequantized(gate_up, gate_up_scale).bfloat16(), _dequantized(down, down_scale).bfloat16())
    for num_tokens in (2, 40):
        x, weights, ids = routed(num_tokens, 256, NUM_EXPERTS, TOP_K, seed=8)
        compiled.fused_experts(x.bfloat16(), weights.bfloat16(), ids, *experts, grouped_mm=False)
    launches = [(fn, args, kwargs) for fn, args, kwargs in recorded if fn.fn.__name__ != "_combine_kernel"]
    assert len(launches) == 4
    for fn, args, kwargs in launches:
        assert "mma" in _ptx(fn, args, kwargs)


# ---- compiled on the GPU ------------------------------------------------------------------------

_35B = SHAPES["35b-a3b"]
E_35B, TOP_K_35B = _35B["num_experts"], _35B["num_experts_per_tok"]
HIDDEN_35B, INTER_35B = _35B["hidden_size"], _35B["moe_intermediate_size"]
# bf16 activations, fp32 accumulation: the all-bf16-rounding reference is further off
EXPERTS_REL = 1e-2
# FP8 kernels vs the bf16 kernels on the same weights (exact in bf16: power-of-two scales): the
# same exact products summed in other orders and tiles, so rounding the activation and each
# expert output to bf16 may flip an ulp (2^-8) here and there
AGAINST_BF16_KERNELS_REL = 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
class TestOnGpu:
    @pytest.fixture(scope="class", params=list(LAYOUTS))
    def experts(self, request) -> tuple[str, tuple[torch.Tensor, ...]]:
        weights = _experts(E_35B, HIDDEN_35B, INTER_35B, request.param, seed=0)
        return request.param, tuple(w.cuda() for w in weights)

    def _routed(self, num_tokens: int, seed: int):
        x, weights, ids = routed(num_tokens, HIDDEN_35B, E_35B, TOP_K_35B, seed, device="cuda")
        return x.bfloat16(), weights.bfloat16(), ids

    # 1..8: decode kernels (<= 128 pairs); 17, 300, 2048: sorted, BLOCK_M 16, 16, 64
    @pytest.mark.parametrize("num_tokens", [1, 2, 8, 17, 300, 2048])
    def test_matches_float64(self, num_tokens: int, experts) -> None:
        layout, (gate_up, gate_up_scale, down, down_scale) = experts
        x, weights, ids = self._routed(num_tokens, seed=100 + num_tokens)
        out = fused_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale)  # the dispatched op
        exact = ref.fused_experts(
            x.double(), weights.double(), ids,
            _dequantized(gate_up, gate_up_scale).double(), _dequantized(down, down_scale).double(),
        )  # fmt: skip
        fp8_ref = ref.fused_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale)
        err, ref_err = relative_error(out, exact), relative_error(fp8_ref, exact)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        assert err < EXPERTS_REL
        assert err <= ref_err * 1.5  # no worse than the reference's bf16 roundings

    @pytest.mark.parametrize("layout", ["row", "block"])
    @pytest.mark.parametrize("num_tokens", [1, 8, 300])
    def test_equals_the_bf16_kernels_on_the_dequantized_weights(self, layout: str, num_tokens: int) -> None:
        gate_up, gate_up_scale, down, down_scale = (
            w.cuda() for w in _experts(E_35B, HIDDEN_35B, INTER_35B, layout, seed=1, power_of_two=True)
        )
        gate_up_bf16 = _dequantized(gate_up, gate_up_scale).bfloat16()
        down_bf16 = _dequantized(down, down_scale).bfloat16()
        assert torch.equal(gate_up_bf16.float(), _dequantized(gate_up, gate_up_scale))  # exact in bf16
        x, weights, ids = self._routed(num_tokens, seed=200 + num_tokens)
        out = fast.fused_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale)
        bf16 = fast.fused_experts(x, weights, ids, gate_up_bf16, down_bf16, grouped_mm=False)
        err = relative_error(out, bf16)
        assert err < AGAINST_BF16_KERNELS_REL

    @pytest.mark.parametrize("grouped_mm", [False, True])
    def test_prefill_paths_match_float64(self, grouped_mm: bool, experts) -> None:
        """2048 tokens on the Triton kernels and on the dequantized grouped GEMM (the default
        from FP8_GROUPED_MM_MIN_PAIRS)."""
        layout, (gate_up, gate_up_scale, down, down_scale) = experts
        x, weights, ids = self._routed(2048, seed=400)
        out = fast.fused_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale, grouped_mm=grouped_mm)
        exact = ref.fused_experts(
            x.double(), weights.double(), ids,
            _dequantized(gate_up, gate_up_scale).double(), _dequantized(down, down_scale).double(),
        )  # fmt: skip
        # The grouped path rounds each dequantized weight to bf16 once (the Triton kernels keep
        # exact products), so only the bf16-operand bound applies to both.
        assert relative_error(out, exact) < EXPERTS_REL

    def test_dequantize_experts_gives_the_reference_bits(self, experts) -> None:
        """The FP8 prefill's one-pass dequantization."""
        _, (gate_up, gate_up_scale, down, down_scale) = experts
        for weight, scale in ((gate_up, gate_up_scale), (down, down_scale)):
            out = fast.dequantize_experts(weight, scale, torch.bfloat16)
            assert torch.equal(out, ref.dequantize_experts(weight, scale, torch.bfloat16))

    def test_decode_replays_from_a_cuda_graph(self, experts) -> None:
        _, (gate_up, gate_up_scale, down, down_scale) = experts
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
        expected = fast.fused_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale)
        assert torch.equal(out, expected)


@interpreter_only
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dequantize_experts_gives_the_reference_bits(layout: str, request: pytest.FixtureRequest) -> None:
    """The one-pass dequantization the FP8 prefill hands to the grouped GEMM: fp32 products rounded once."""
    request.getfixturevalue("bf16_round_to_nearest_even")  # the GPU's conversion, not the interpreter's
    gen = torch.Generator().manual_seed(len(layout))
    codes, scale = _fp8_weight(3, 200, 136, LAYOUTS[layout], gen)  # partial 128-row and 128-column blocks
    for dtype in (torch.float32, torch.bfloat16):
        out = fast.dequantize_experts(codes, scale, dtype, block_n=32, block_k=64)
        assert out.dtype == dtype and torch.equal(out, ref.dequantize_experts(codes, scale, dtype))
