"""Our Triton GEMV (bf16/fp16/fp32 and FP8 weights, M <= 16) under Triton's CPU interpreter vs ref.py.

Shapes are small and nothing is a block multiple (N=200, K=300: masked K tails, clamped
rows and columns). Both inner products (FMA and DOT), split-K, the three FP8 scale layouts
(per channel, 128 x 128 blocks, row blocks), bias and strided x rows are covered. The interpreter's tl.dot multiplies bf16 operands as
raw integers, so the DOT path runs here with fp16 and fp32 x only (FP8 DOT: the fp16 and
fp32 forms of the bit-move conversion; its bf16 form is checked on all 256 codes by
itself); tests/gpu/test_gemv.py covers bf16 DOT, the inline-PTX conversion (and every
path compiled) at the real shapes.

Tolerances, against a float64 evaluation of the same (dequantized) inputs: the kernel sums
in fp32 in a different order than torch, so fp32 outputs agree to ~1e-6 of the terms'
magnitude; 16-bit outputs are rounded once, which the interpreter may do toward zero: up
to one unit in the last place (2^-7 bf16, 2^-10 fp16) relative, plus the fp32 sum error.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels import gemv as gemv_op
from ninfer.kernels.gemv import ref
from tests.kernels.interpreter import cpu_interpreter, interpreted  # noqa: F401 (autouse fixture)

fast = interpreted("ninfer.kernels.gemv.triton")
Config = fast.Config

N, K = 200, 300
FP8 = torch.float8_e4m3fn
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 0.0}
# Few programs per launch keep the interpreter fast: wide tiles, small K steps.
FMA = Config(block_n=64, block_k=128, num_warps=4)
DOT = Config(block_n=64, block_k=64, num_warps=4, use_dot=True)


def _inputs(m: int, dtype: torch.dtype, seed: int, fp8: bool = False, row_stride: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, row_stride or K, generator=gen).to(dtype)[:, :K]
    w = torch.randn(N, K, generator=gen) * K**-0.5
    bias = torch.randn(N, generator=gen).to(dtype)
    if fp8:
        w = (w * 64).to(FP8)  # spread over e4m3's range, subnormals included
    else:
        w = w.to(dtype)
    return x, w, bias


def _channel_scale(seed: int) -> torch.Tensor:
    return torch.rand(N, generator=torch.Generator().manual_seed(seed)) / 64 + 1e-3


def _block_scale(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(-(-N // 128), -(-K // 128), generator=gen) / 64 + 1e-3


def _row_scale(seed: int) -> torch.Tensor:
    """Row blocks [N, ceil(K/128)]: a different scale for every row and K block."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(N, -(-K // 128), generator=gen) / 64 + 1e-3


SCALES = {"channel": _channel_scale, "block": _block_scale, "row": _row_scale}


def _check(out: torch.Tensor, x, w, scale=None, bias=None) -> None:
    exact = x.double() @ ref.dequantize(w, scale).double().T
    if bias is not None:
        exact = exact + bias.double()
    assert out.shape == (x.shape[0], N) and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), exact, rtol=ULP[x.dtype], atol=1e-5 * exact.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_fma_matches_reference(dtype: torch.dtype, m: int) -> None:
    x, w, bias = _inputs(m, dtype, seed=m)
    _check(fast.gemv(x, w, bias=bias, config=FMA), x, w, bias=bias)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 16, 24])  # 24: x padded to 32 rows
def test_dot_matches_reference(dtype: torch.dtype, m: int) -> None:
    x, w, bias = _inputs(m, dtype, seed=10 + m)
    _check(fast.gemv(x, w, bias=bias, config=DOT), x, w, bias=bias)


@pytest.mark.parametrize("config", [FMA._replace(split_k=3), DOT._replace(split_k=2)])
def test_split_k_matches_reference(config: Config) -> None:
    x, w, bias = _inputs(5, torch.float16, seed=3)
    _check(fast.gemv(x, w, bias=bias, config=config), x, w, bias=bias)


@pytest.mark.parametrize(
    "dtype, config",
    [
        (torch.bfloat16, FMA),
        (torch.bfloat16, FMA._replace(block_k=512)),  # a 512-wide step spans several 128-blocks
        (torch.float16, DOT),
        (torch.float16, DOT._replace(block_k=256)),  # two 128-wide slices per step
        (torch.float32, FMA._replace(split_k=2)),  # fp32 x: 8-byte weight vectors
        (torch.float32, DOT),
    ],
)
@pytest.mark.parametrize("m", [1, 8, 16, 32])  # M = 3 (padded rows) with FP8: test_strided_rows
@pytest.mark.parametrize("layout", list(SCALES))
def test_fp8_matches_reference(dtype: torch.dtype, config: Config, m: int, layout: str) -> None:
    x, w, bias = _inputs(m, dtype, seed=20 + m, fp8=True)
    scale = SCALES[layout](m)
    _check(fast.gemv(x, w, scale, bias, config=config), x, w, scale, bias)


@pytest.mark.parametrize(
    "dtype, config",
    [
        (torch.bfloat16, FMA),
        (torch.float16, DOT._replace(block_k=256)),
        (torch.float32, DOT._replace(split_k=2)),
    ],
)
@pytest.mark.parametrize("m", [1, 5])
def test_row_blocks_equal_expanded_128x128_blocks(dtype: torch.dtype, config: Config, m: int) -> None:
    # The 128 x 128 scales expanded to one row per weight row: the same products, summed in
    # the same order, so the same bits.
    x, w, bias = _inputs(m, dtype, seed=40 + m, fp8=True)
    blocks = _block_scale(40 + m)
    rows = blocks.repeat_interleave(128, 0)[:N]
    assert ref.scale_rows_per_block(w, blocks) == 128 and ref.scale_rows_per_block(w, rows) == 1
    assert torch.equal(ref.dequantize(w, rows), ref.dequantize(w, blocks))
    assert torch.equal(fast.gemv(x, w, rows, bias, config=config), fast.gemv(x, w, blocks, bias, config=config))


@pytest.mark.parametrize("config", [FMA, DOT])
def test_strided_rows(config: Config) -> None:
    x, w, _ = _inputs(3, torch.float16, seed=5, row_stride=K + 36)
    assert x.stride(0) == K + 36
    _check(fast.gemv(x, w, config=config), x, w)
    x8, w8, _ = _inputs(3, torch.float16, seed=6, fp8=True, row_stride=K + 20)
    for scale in (_block_scale(6), _row_scale(6)):
        _check(fast.gemv(x8, w8, scale, config=config), x8, w8, scale)


@pytest.mark.parametrize("config", [FMA, FMA._replace(split_k=3), FMA._replace(block_k=512)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("k", [K, 256])  # K = 300: masked tails; 256: whole steps (EVEN_K)
def test_prefetch_sums_the_same_products_in_the_same_order(config: Config, fp8: bool, k: int) -> None:
    # Loading the next weight tile early changes when the bytes arrive, not the arithmetic:
    # the same bits as the plain loop, at every split and tail.
    x, w, bias = _inputs(3, torch.bfloat16, seed=50 + k, fp8=fp8)
    x, w = x[:, :k], w[:, :k].contiguous()
    scale = _row_scale(50)[:, : -(-k // 128)].contiguous() if fp8 else None
    plain = fast.gemv(x, w, scale, bias, config=config)
    prefetched = fast.gemv(x, w, scale, bias, config=config._replace(prefetch=True))
    assert torch.equal(prefetched, plain)
    exact = x.double() @ ref.dequantize(w, scale).double().T + bias.double()
    torch.testing.assert_close(plain.double(), exact, rtol=ULP[x.dtype], atol=1e-5 * exact.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_e4m3_bits_all_codes(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # The FP8 DOT conversion (Triton-op form; the GPU test checks the inline PTX): every
    # e4m3 code, subnormals and -0 included, is exactly its value times 2^-fold. NaN
    # (0x7F, 0xFF) is outside the contract (checkpoints clamp to +-448).
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel below, built for the interpreter
    import triton
    import triton.language as tl

    @triton.jit
    def convert(w_ptr, out_ptr, DTYPE: tl.constexpr):
        i = tl.arange(0, 256)
        tl.store(out_ptr + i, fast._e4m3_bits(tl.load(w_ptr + i), DTYPE, False))

    w = torch.arange(256, dtype=torch.uint8).view(FP8)
    out = torch.empty(256, dtype=dtype)
    tl_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]
    convert[(1,)](w, out, DTYPE=tl_dtype)
    fold = 2.0 ** (8 if dtype == torch.float16 else 120)
    finite = ~torch.isnan(w.float())
    assert torch.equal(out.double()[finite] * fold, w.double()[finite])
    assert torch.equal(torch.signbit(out.float()[finite]), torch.signbit(w.float()[finite]))  # -0 stays -0


activation = interpreted("ninfer.kernels.activation.triton")


@pytest.mark.parametrize(
    "dtype, config",
    [
        (torch.bfloat16, FMA),  # 32 gate + 32 up rows per program, a masked last program (I = 100)
        # One pair per program, as 27B's gate_up at M = 1 (interpreted tiles this narrow take ~10 s).
        pytest.param(torch.bfloat16, FMA._replace(block_n=2, prefetch=True), marks=pytest.mark.slow),
        (torch.float16, DOT),
        pytest.param(torch.float32, FMA._replace(block_n=4), marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("m", [3])  # padded rows; M = 1 below
@pytest.mark.parametrize("layout", [None, *SCALES])
def test_silu_and_mul_epilogue_equals_the_two_launches(
    dtype: torch.dtype, config: Config, m: int, layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Gate and up rows are summed as the plain GEMV sums them and rounded to x's dtype before
    # the activation's own formula: the same bits as gemv then silu_and_mul, same config.
    # (DOT launches take the two launches themselves.)
    fallbacks = []
    monkeypatch.setattr(fast, "silu_and_mul", lambda t: fallbacks.append(t.shape) or activation.silu_and_mul(t))
    x, w, bias = _inputs(m, dtype, seed=60 + m, fp8=layout is not None)
    scale = SCALES[layout](60 + m) if layout else None
    fused = fast.gemv_silu_and_mul(x, w, scale, bias, config=config)
    assert len(fallbacks) == int(config.use_dot)  # FMA: the epilogue ran
    two_launches = activation.silu_and_mul(fast.gemv(x, w, scale, bias, config=config))
    assert fused.shape == (m, N // 2) and fused.dtype == dtype
    assert torch.equal(fused, two_launches)
    expected = ref.gemv_silu_and_mul(x, w, scale, bias)
    torch.testing.assert_close(fused.float(), expected.float(), rtol=4 * ULP[dtype] + 1e-5, atol=1e-3)


@pytest.mark.slow
def test_silu_and_mul_epilogue_one_row_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    config = FMA._replace(block_n=2, prefetch=True)
    test_silu_and_mul_epilogue_equals_the_two_launches(torch.bfloat16, config, 1, "channel", monkeypatch)


@pytest.mark.slow
def test_silu_and_mul_epilogue_falls_back_where_it_cannot_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    # Split K (the sums are whole only in the split-sum kernel), odd row tiles and tensor-core
    # launches (measured slower fused) take two launches.
    fallbacks = []
    monkeypatch.setattr(fast, "silu_and_mul", lambda t: fallbacks.append(t.shape) or activation.silu_and_mul(t))
    x, w, bias = _inputs(2, torch.float16, seed=70)
    for config in (FMA._replace(split_k=3), FMA._replace(block_n=1), DOT):
        fused = fast.gemv_silu_and_mul(x, w, bias=bias, config=config)
        assert torch.equal(fused, activation.silu_and_mul(fast.gemv(x, w, bias=bias, config=config)))
    assert len(fallbacks) == 3
    with pytest.raises(ValueError, match="gate | up"):
        fast.gemv_silu_and_mul(x, w[:-1].contiguous())
    # The default launch keeps a row pair per program even where the plain GEMV takes one row.
    assert fast._config(1, 1024, 2048, FP8, 132).block_n == 1
    assert fast._config(1, 1024, 2048, FP8, 132, 2).block_n == 2


conv_kernels = interpreted("ninfer.kernels.causal_conv1d.triton")
CONV_CHANNELS, CONV_WIDTH, NUM_SLOTS = 136, 4, 5


def _conv_inputs(m: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    conv_weight = (torch.randn(CONV_CHANNELS, CONV_WIDTH, generator=gen) * 0.5).to(dtype)
    conv_state = torch.randn(NUM_SLOTS, CONV_CHANNELS, CONV_WIDTH - 1, generator=gen).to(dtype)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:m]
    return conv_weight, conv_state, slots


@pytest.mark.parametrize(
    "dtype, config, layout",
    [
        (torch.bfloat16, FMA, None),  # columns 128..135 of the conv in one program's tile with plain ones
        # As 27B's in_proj at M = 1 (interpreted tiles this narrow take ~10 s).
        pytest.param(torch.bfloat16, FMA._replace(block_n=2, prefetch=True), "channel", marks=pytest.mark.slow),
        (torch.float16, DOT, "row"),
        pytest.param(torch.float32, FMA._replace(block_n=4), "block", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("m", [1, 3])
def test_conv_epilogue_equals_the_two_launches(dtype: torch.dtype, config: Config, layout, m: int) -> None:
    # The projection rounded to x's dtype, then the conv kernel's own sum: the same output bits
    # and the same updated states as the GEMV followed by causal_conv1d_update.
    x, w, bias = _inputs(m, dtype, seed=80 + m, fp8=layout is not None)
    scale = SCALES[layout](80 + m) if layout else None
    conv_weight, state, slots = _conv_inputs(m, dtype, seed=90 + m)
    fused_state, plain_state = state.clone(), state.clone()
    fused = fast.gemv_causal_conv1d_update(x, w, scale, bias, conv_weight, fused_state, slots, config=config)
    plain = fast.gemv(x, w, scale, bias, config=config)
    mixed = conv_kernels.causal_conv1d_update(plain[:, :CONV_CHANNELS], conv_weight, plain_state, slots)
    assert fused.shape == (m, N) and fused.dtype == dtype
    assert torch.equal(fused[:, :CONV_CHANNELS], mixed) and torch.equal(fused[:, CONV_CHANNELS:], plain[:, CONV_CHANNELS:])
    assert torch.equal(fused_state, plain_state) and not torch.equal(fused_state, state)
    ref_state = state.clone()
    expected = ref.gemv_causal_conv1d_update(x, w, scale, bias, conv_weight, ref_state, slots)
    # A one-unit difference in a rounded projection (sum order, the interpreter's rounding)
    # moves a conv output by up to a unit times its tap: absolute, as taps may cancel.
    atol = 2 * ULP[dtype] * plain.abs().max().item() * conv_weight.abs().max().item() + 1e-5
    torch.testing.assert_close(fused.float(), expected.float(), rtol=4 * ULP[dtype] + 1e-5, atol=atol)
    torch.testing.assert_close(fused_state.float(), ref_state.float(), rtol=ULP[dtype], atol=1e-3)


def test_conv_epilogue_falls_back_to_two_launches_with_split_k(monkeypatch: pytest.MonkeyPatch) -> None:
    # Split K: the plain GEMV (same config), then the conv on its first columns.
    fallbacks = []

    def spy(out, *conv):
        fallbacks.append(out.clone())
        return gemv_op.conv_first_columns(out, *conv)

    monkeypatch.setattr(fast, "conv_first_columns", spy)
    x, w, bias = _inputs(2, torch.float16, seed=95)
    conv_weight, state, slots = _conv_inputs(2, torch.float16, seed=96)
    config = FMA._replace(split_k=3)
    fused_state, plain_state = state.clone(), state.clone()
    fused = fast.gemv_causal_conv1d_update(x, w, None, bias, conv_weight, fused_state, slots, config=config)
    plain = fast.gemv(x, w, bias=bias, config=config)
    assert len(fallbacks) == 1 and torch.equal(fallbacks[0], plain)
    assert torch.equal(fused, gemv_op.conv_first_columns(plain, conv_weight, plain_state, slots))
    assert torch.equal(fused_state, plain_state) and not torch.equal(fused_state, state)
    with pytest.raises(ValueError, match="conv_state"):
        fast.gemv_causal_conv1d_update(x, w, None, None, conv_weight, state[:, :, :2], slots)
    with pytest.raises(ValueError, match="state_slots"):
        fast.gemv_causal_conv1d_update(x, w, None, None, conv_weight, state, slots[:1])


def test_default_config() -> None:
    # The heuristic's own launch at M=16 (DOT; fp16 so it runs here). At M=1 it gives this
    # small N one column per program: 200 interpreted programs, too slow to be worth it.
    x, w, bias = _inputs(16, torch.float16, seed=30)
    _check(fast.gemv(x, w, bias=bias), x, w, bias=bias)


def test_heuristic_on_real_shapes() -> None:
    shapes = [(16480, 5120), (5120, 6144), (34816, 5120), (5120, 17408), (248320, 5120), (2048, 4096), (256, 2048)]
    for n, k in shapes:
        for m in (1, 2, 4, 8, 16, 24, 32):
            for dtype in (torch.bfloat16, FP8):
                cfg = fast._config(m, n, k, dtype, 132)
                vec = 16 // torch.empty((), dtype=dtype).element_size()
                if cfg.use_dot:
                    assert cfg.block_n >= 16 and cfg.block_k >= 16
                    if dtype == FP8:
                        # 16 weight rows per warp and MMA: no warp converts another's weights
                        assert cfg.block_n % (16 * cfg.num_warps) == 0 and cfg.num_warps <= 2
                else:
                    # one 16-byte vector per thread per row: no layout conversion in the loop
                    assert cfg.block_k // vec >= 32 * cfg.num_warps
                # Real shapes: no masked tail, except FP8 at M = 1 on 17 KiB rows (2 KiB steps,
                # the last one masked, measured fastest on 5120 x 17408).
                assert k % cfg.block_k == 0 or (dtype == FP8 and m == 1 and k % 1024 == 0)
                programs = -(-n // cfg.block_n) * cfg.split_k
                # 16-bit DOT tiles stream at the copy bandwidth from one program per SM, FP8 ones
                # above 16 rows too (measured)
                min_programs = 132 if cfg.use_dot and (dtype != FP8 or m > 16) else 2 * 132
                assert programs >= min_programs or k // cfg.split_k < 4 * cfg.block_k
    assert fast._config(1, 5120, 6144, torch.bfloat16, 132) is fast._config(1, 5120, 6144, torch.bfloat16, 132)
    # FP8: FMA at M = 1, and at M = 2 from N = 4096 on, as 2 rows x 1 KiB on 2 warps (measured
    # on the 27B shapes, docs/kernels.md); DOT below; bf16 DOT at M = 4 and 16 on the 27B shapes:
    # 32 columns on 2 warps, 128-wide K steps on wide matrices, 256-wide unsplit on 5120 rows (measured).
    assert [fast._config(m, 16480, 5120, FP8, 132).use_dot for m in (1, 2, 4, 16)] == [False, False, True, True]
    for n, k in [(16480, 5120), (5120, 6144), (34816, 5120), (5120, 17408)]:
        assert fast._config(2, n, k, FP8, 132)[:5] == (2, 1024, 2, 1, False)
    assert fast._config(2, 2048, 4096, FP8, 132).use_dot
    for m in (4, 16):
        for n, k in [(16480, 5120), (14336, 5120), (34816, 5120)]:
            assert fast._config(m, n, k, torch.bfloat16, 132)[:4] == (32, 128, 2, 3)
    # Above 16 rows (verify rounds of 8 requests; measured at M = 24 and 32): 64 columns where they
    # make 1-3 programs per SM, 256-wide K steps on the widest; FP8 unsplit from 132 programs, split 3 deep.
    for m in (24, 32):
        for n, k in [(16480, 5120), (14336, 5120)]:
            assert fast._config(m, n, k, torch.bfloat16, 132)[:6] == (64, 128, 2, 3, True, 1)
            assert fast._config(m, n, k, FP8, 132)[:6] == (64, 256, 2, 4, True, 1)
        assert fast._config(m, 34816, 5120, torch.bfloat16, 132)[:6] == (32, 256, 2, 3, True, 1)
        assert fast._config(m, 5120, 17408, FP8, 132)[:6] == (64, 256, 2, 3, True, 4)
        for n, k in [(5120, 6144), (5120, 17408)]:
            assert fast._config(m, n, k, torch.bfloat16, 132)[:6] == (32, 256, 2, 4, True, 1)


def test_invalid_inputs() -> None:
    x, w, _ = _inputs(2, torch.float16, seed=0)
    with pytest.raises(ValueError):
        fast.gemv(torch.randn(fast.MAX_ROWS + 1, K).half(), w)
    with pytest.raises(ValueError):
        fast.gemv(x, w.float())
    with pytest.raises(ValueError):
        fast.gemv(x, w.to(FP8))  # FP8 needs scales
    with pytest.raises(ValueError):
        fast.gemv(x, w.to(FP8), torch.ones(2, 2))  # block scales of the wrong shape
    with pytest.raises(ValueError):
        fast.gemv(x, w.to(FP8), torch.ones(N, 2))  # row blocks of the wrong width
    with pytest.raises(ValueError):
        fast.gemv(x, w.to(FP8), torch.ones(N + 1))  # channel scales of the wrong length
    with pytest.raises(ValueError):
        fast.gemv(x, w, config=Config(block_n=8, block_k=64, use_dot=True))  # DOT needs 16 columns


def test_ref_block_dequantization_is_the_explicit_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    n, k = 260, 140  # 3 x 2 blocks, both partial
    w = (torch.randn(n, k, generator=gen) * 32).to(FP8)
    scale = torch.rand(3, 2, generator=gen)
    expected = torch.empty(n, k)
    for i in range(n):
        for j in range(k):
            expected[i, j] = w[i, j].float() * scale[i // 128, j // 128]
    assert torch.equal(ref.dequantize(w, scale), expected)
    assert torch.equal(ref.dequantize(w, scale[:, 0].repeat_interleave(128)[:n]), w.float() * scale[:, 0].repeat_interleave(128)[:n, None])
    rows = torch.rand(n, 2, generator=gen)  # row blocks: a scale per row and 128-wide K block
    for i in range(n):
        for j in range(k):
            expected[i, j] = w[i, j].float() * rows[i, j // 128]
    assert torch.equal(ref.dequantize(w, rows), expected)


def test_scale_rows_per_block_rule() -> None:
    def rows(n: int, k: int, shape: tuple[int, ...]) -> int | None:
        return ref.scale_rows_per_block(torch.empty(n, k, dtype=FP8), torch.empty(shape))

    # (N, ceil(K/128)) with N > 1: row blocks; (ceil(N/128), ceil(K/128)): 128 x 128 blocks.
    assert rows(200, 300, (200, 3)) == 1 and rows(200, 300, (2, 3)) == 128
    assert rows(128, 128, (128, 1)) == 1 and rows(128, 128, (1, 1)) == 128
    assert rows(129, 256, (129, 2)) == 1 and rows(129, 256, (2, 2)) == 128
    assert rows(2, 300, (2, 3)) == 1 and rows(2, 300, (1, 3)) == 128
    assert rows(1, 300, (1, 3)) == 128  # N = 1: both layouts are this one tensor
    for shape in [(200,), (200, 2), (3, 3), (201, 3), (2, 3, 1)]:
        assert rows(200, 300, shape) is None
    assert ref.scale_rows_per_block(torch.empty(4, 4, dtype=FP8), None) is None
    with pytest.raises(ValueError):
        ref.dequantize(torch.zeros(200, 300, dtype=FP8), torch.ones(200, 2))


def test_ref_semantics_and_cpu_dispatch() -> None:
    x, w, bias = _inputs(3, torch.bfloat16, seed=1, fp8=True)
    scale = _channel_scale(1)
    expected = (x.float() @ (w.float() * scale[:, None]).T + bias.float()).to(x.dtype)
    assert torch.equal(ref.gemv(x, w, scale, bias), expected)
    assert torch.equal(gemv_op.gemv(x, w, scale, bias), expected)  # CPU tensors: the reference
    assert gemv_op.MAX_ROWS == fast.MAX_ROWS == 32
