"""The NVFP4 weight-only GEMV: ref.py's layout and quantization on the CPU, the Triton kernel
against it under Triton's CPU interpreter, and (marked gpu) compiled on CUDA at the 27B shapes.

Interpreter shapes are small and N = 37 is no multiple of a tile (clamped rows, a masked
store); K = 32 and 160 end in a half-masked step with the configs used, and the default
launch takes K = 48 as 3 vectors of a 32-vector step. Codes are random bytes (all 16 codes,
-0 included), block scales span e4m3 from subnormals to 448 with a fifth of the blocks zero,
row scales span 2^-6..2^2.

Tolerances, against a float64 product of the reference's dequantized weight: the kernel
sums in fp32 in its own order and multiplies row_scale * (block_scale * value) where the
reference rounds block_scale * row_scale first, so fp32 outputs agree to ~1e-6 of the terms'
magnitude (atol 1e-5 of the largest output); bf16 outputs are rounded once, which the
interpreter may do toward zero: one unit in the last place (2^-7) relative.

The interpreter module skips itself where a GPU is present, which would take the gpu tests
with it; so this file imports it only on CPU-only machines, and marks which tests need which.
"""

from __future__ import annotations

import struct

import pytest
import torch

from ninfer.kernels import nvfp4_gemv as nvfp4_op
from ninfer.kernels.nvfp4_gemv.ref import MAX_ROWS
from ninfer.kernels.nvfp4_gemv import ref
from tests.kernels.nvfp4_samples import exact_product, random_activations, random_weights

ON_GPU = torch.cuda.is_available()
if ON_GPU:
    pytest.importorskip("triton")
    from ninfer.kernels.nvfp4_gemv import triton as fast
else:
    from tests.kernels.interpreter import cpu_interpreter, interpreted  # noqa: F401 (autouse fixture)

    fast = interpreted("ninfer.kernels.nvfp4_gemv.triton")

Config = fast.Config
E4M3 = torch.float8_e4m3fn
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 0.0}
interpreter_only = pytest.mark.skipif(ON_GPU, reason="the CPU interpreter runs where no GPU is; the gpu tests cover the kernel")

N = 37
# Few programs per launch keep the interpreter fast: 16 rows per program, 64-code steps.
# 16-code vectors (one scale block) as the default launch takes up to M = 4, 8-code above.
NARROW = Config(block_n=16, block_k=64, vec_bytes=8, num_warps=1)
HALF_VECTORS = Config(block_n=16, block_k=64, vec_bytes=4, num_warps=1)


def _check(out: torch.Tensor, x, packed, block_scale, row_scale, bias=None) -> None:
    exact = exact_product(x, packed, block_scale, row_scale, bias)
    assert out.shape == (x.shape[0], packed.shape[0]) and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), exact, rtol=ULP[x.dtype], atol=1e-5 * exact.abs().max().item())


# --- ref.py on the CPU ---------------------------------------------------------------------


def test_known_codes_decode_to_the_e2m1_table() -> None:
    # Byte 0x9A: low nibble 0xA (sign, magnitude 2) = -1.0, element 0; high 0x9 = -0.5, element 1.
    one_byte = torch.full((1, 8), 0x9A, dtype=torch.uint8)
    ones = torch.ones(1, 1).to(E4M3)
    assert ref.dequantize_nvfp4(one_byte, ones, torch.ones(1)).tolist() == [[-1.0, -0.5] * 8]
    # Codes 0..15 in order, two a byte (low nibble first): 0x10, 0x32, ..., 0xFE.
    every_code = torch.tensor([[(2 * i) | ((2 * i + 1) << 4) for i in range(8)]], dtype=torch.uint8)
    table = [*ref.E2M1_VALUES, *(-v for v in ref.E2M1_VALUES)]
    decoded = ref.dequantize_nvfp4(every_code, ones, torch.ones(1))
    assert decoded.tolist() == [table]
    assert torch.signbit(decoded[0, 8]) and not torch.signbit(decoded[0, 0])  # code 8 is -0
    # Both scales multiply every value of their block and row.
    scaled = ref.dequantize_nvfp4(every_code, torch.full((1, 1), 3.0).to(E4M3), torch.tensor([0.25]))
    assert scaled.tolist() == [[0.75 * v for v in table]]
    assert torch.equal(ref.pack_codes(ref.unpack_codes(every_code)), every_code)


def _normal_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian rows of different magnitudes, every fifth 16-block zero."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 10
    w.view(n, k // ref.BLOCK, ref.BLOCK)[:, ::5] = 0.0
    return w


def test_quantize_of_the_dequantized_weight_gives_the_same_bytes() -> None:
    packed, block_scale, row_scale = ref.quantize_nvfp4(_normal_weight(64, 256, seed=0))
    assert (block_scale.float() == 0).any()  # zero blocks take a zero scale
    dequantized = ref.dequantize_nvfp4(packed, block_scale, row_scale)
    packed2, block_scale2, row_scale2 = ref.quantize_nvfp4(dequantized)
    assert torch.equal(packed2, packed)
    assert torch.equal(block_scale2.view(torch.uint8), block_scale.view(torch.uint8))
    # The row scale is recomputed from the dequantized row's amax (6 * 448 * row_scale, rounded
    # in fp32), so it comes back within a few fp32 units, not always bit for bit.
    torch.testing.assert_close(row_scale2, row_scale, rtol=2**-21, atol=0.0)


def test_quantization_error_is_within_half_an_e2m1_step() -> None:
    w = _normal_weight(48, 512, seed=1)
    packed, block_scale, row_scale = ref.quantize_nvfp4(w)
    error = (ref.dequantize_nvfp4(packed, block_scale, row_scale) - w).abs()
    scale = (block_scale.float() * row_scale[:, None]).repeat_interleave(ref.BLOCK, dim=1)
    # e2m1 steps are 0.5 up to 2, 1 up to 4, 2 up to 6; a block's largest value may exceed
    # 6 * scale (its e4m3 scale rounded down by up to 2^-4), still within the last half step.
    units = w.abs() / scale.clamp(min=1e-30)
    half_step = torch.where(units <= 2, 0.25, torch.where(units <= 4, 0.5, 1.0))
    assert (units <= 6 / (1 - 2**-4)).all()
    assert (error <= half_step * scale * (1 + 1e-6)).all()
    assert (error[scale == 0] == 0).all()  # zero blocks come back exactly


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ref_gemv_is_x_times_the_dequantized_weight(dtype: torch.dtype) -> None:
    packed, block_scale, row_scale = random_weights(N, 64, seed=2)
    x, bias = random_activations(3, N, 64, dtype, seed=2)
    weight = ref.dequantize_nvfp4(packed, block_scale, row_scale)
    assert weight.dtype == torch.float32 and weight.shape == (N, 64)
    assert torch.equal(ref.gemv_nvfp4(x, packed, block_scale, row_scale), (x.float() @ weight.T).to(dtype))
    expected = (x.float() @ weight.T + bias.float()).to(dtype)
    assert torch.equal(ref.gemv_nvfp4(x, packed, block_scale, row_scale, bias), expected)
    assert torch.equal(nvfp4_op.gemv_nvfp4(x, packed, block_scale, row_scale, bias), expected)  # CPU: the reference


# --- the Triton kernel under the CPU interpreter ---------------------------------------------


@interpreter_only
@pytest.mark.parametrize("double_buffer", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [32, 64, 160])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_matches_reference(m: int, k: int, dtype: torch.dtype, with_bias: bool, double_buffer: bool) -> None:
    # k = 32: one step, 64: whole steps, 160: a masked last step (each loaded a step ahead with double_buffer).
    packed, block_scale, row_scale = random_weights(N, k, seed=k + m)
    x, bias = random_activations(m, N, k, dtype, seed=m)
    bias = bias if with_bias else None
    config = (NARROW if m <= 4 else HALF_VECTORS)._replace(double_buffer=double_buffer)
    _check(fast.gemv_nvfp4(x, packed, block_scale, row_scale, bias, config=config), x, packed, block_scale, row_scale, bias)


# The tensor-core path: 16 weight rows (one warp), a scale block per MMA; K a multiple of block_k.
DOT = Config(block_n=16, block_k=32, num_warps=1, use_dot=True, num_stages=2)


@interpreter_only
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("k", [32, 160])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_dot_matches_reference(m: int, k: int, with_bias: bool) -> None:
    # Random bytes (every code, -0 included) and block scales from e4m3 subnormals to 448.
    # fp32 x: the interpreter multiplies bf16 operands of tl.dot as another type; the weight
    # tile's widening is the GEMM's (test_nvfp4_gemm_triton: every code and scale, bf16 too).
    packed, block_scale, row_scale = random_weights(N, k, seed=70 + k + m)
    x, bias = random_activations(m, N, k, torch.float32, seed=70 + m)
    bias = bias if with_bias else None
    _check(fast.gemv_nvfp4(x, packed, block_scale, row_scale, bias, config=DOT), x, packed, block_scale, row_scale, bias)


@interpreter_only
@pytest.mark.parametrize("m, k, split_k", [(3, 96, 2), (8, 160, 4), (2, 64, 8)])
def test_dot_split_k_matches_reference(m: int, k: int, split_k: int) -> None:
    # 160 / 32 = 5 steps in 4 splits: whole steps per split, the last one short; 64 in 8: only 2 splits exist.
    packed, block_scale, row_scale = random_weights(N, k, seed=90 + k)
    x, bias = random_activations(m, N, k, torch.float32, seed=90 + m)
    out = fast.gemv_nvfp4(x, packed, block_scale, row_scale, bias, config=DOT._replace(split_k=split_k))
    _check(out, x, packed, block_scale, row_scale, bias)


@interpreter_only
def test_dot_takes_bf16_or_fp32_x_and_whole_steps() -> None:
    packed, block_scale, row_scale = random_weights(N, 48, seed=80)
    with pytest.raises(ValueError, match="DOT"):
        fast.gemv_nvfp4(torch.randn(2, 48).half(), packed, block_scale, row_scale, config=DOT)  # fp16 x
    with pytest.raises(ValueError, match="DOT"):
        fast.gemv_nvfp4(torch.randn(2, 48).bfloat16(), packed, block_scale, row_scale, config=DOT)  # 48 % 32


@interpreter_only
@pytest.mark.parametrize("m, k, dtype", [(2, 48, torch.float32), (8, 64, torch.float16)])
def test_default_config(m: int, k: int, dtype: torch.dtype) -> None:
    # The heuristic's own launch; at this small N it takes one row per program (37 programs).
    # K = 48: a masked last step. fp16: row scales cut by 2^-10 to keep the sums in its range.
    packed, block_scale, row_scale = random_weights(N, k, seed=30 + m)
    if dtype == torch.float16:
        row_scale = row_scale * 2**-10
    x, bias = random_activations(m, N, k, dtype, seed=30 + m)
    _check(fast.gemv_nvfp4(x, packed, block_scale, row_scale, bias), x, packed, block_scale, row_scale, bias)


@interpreter_only
@pytest.mark.parametrize("m, k", [(1, 160), (2, 64), (5, 96)])
def test_double_buffer_gives_the_same_bits(m: int, k: int) -> None:
    # The same sums in the same order: only when each step's loads are issued differs.
    packed, block_scale, row_scale = random_weights(N, k, seed=50 + k)
    x, bias = random_activations(m, N, k, torch.bfloat16, seed=50 + m)
    config = NARROW if m <= 4 else HALF_VECTORS
    single = fast.gemv_nvfp4(x, packed, block_scale, row_scale, bias, config=config)
    assert torch.equal(fast.gemv_nvfp4(x, packed, block_scale, row_scale, bias, config=config._replace(double_buffer=True)), single)


@interpreter_only
def test_strided_rows() -> None:
    # x, weight and block_scale as column slices of wider buffers: row strides are honoured.
    k = 64
    packed, block_scale, row_scale = random_weights(N, k + 32, seed=40)
    packed, block_scale = packed[:, : k // 2], block_scale[:, : k // ref.BLOCK]
    x = random_activations(3, N, k + 24, torch.bfloat16, seed=40)[0][:, :k]
    assert packed.stride(0) == (k + 32) // 2 and x.stride(0) == k + 24
    _check(fast.gemv_nvfp4(x, packed, block_scale, row_scale, config=NARROW), x, packed, block_scale, row_scale)


@interpreter_only
def test_decode_of_every_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    # The in-register decode on all 256 bytes: both nibbles exactly their e2m1 values times
    # 2^-14, -0 (code 8) included.
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel below, built for the interpreter
    import triton
    import triton.language as tl

    @triton.jit
    def decode(packed_ptr, low_ptr, high_ptr):
        i = tl.arange(0, 256)
        low, high = fast._decode(tl.load(packed_ptr + i))
        tl.store(low_ptr + i, low)
        tl.store(high_ptr + i, high)

    packed = torch.arange(256, dtype=torch.uint8)
    low, high = torch.empty(256), torch.empty(256)
    decode[(1,)](packed, low, high)
    expected = ref.dequantize_nvfp4(packed.view(16, 16), torch.ones(16, 2).to(E4M3), torch.ones(16))
    expected = expected.view(256, 2)
    assert torch.equal(torch.stack((low, high), dim=1) * 2**14, expected)
    assert torch.equal(torch.signbit(low), torch.signbit(expected[:, 0]))
    assert torch.equal(torch.signbit(high), torch.signbit(expected[:, 1]))


def _run_ptx(lines: tuple[str, ...], operands: dict[str, int]) -> dict[str, int]:
    """The decode's PTX instructions evaluated on Python ints, per the PTX ISA: and, shr, shl,
    mov, prmt (default mode: selector nibble i picks byte i of {b, a}, bit 3 copying that byte's
    top bit over it), lop3 (the lookup table over the bits of a, b, c) and fma.rn.bf16x2 (each
    half rounded to nearest even from the exact result; the tests' products are exact)."""
    regs = dict(operands)
    value = lambda token: regs[token] if token in regs else int(token, 0)  # noqa: E731

    def bf16(bits: int) -> float:
        return struct.unpack("<f", struct.pack("<I", bits << 16))[0]

    def bf16_bits(number: float) -> int:
        return torch.tensor([number]).bfloat16().view(torch.int16).item() & 0xFFFF

    for line in lines:
        op, args = line.rstrip(";").split(None, 1)
        dest, *sources = [a.strip() for a in args.split(",")]
        v = [value(t) for t in sources]
        if op == "and.b32":
            out = v[0] & v[1]
        elif op == "shr.b32":
            out = v[0] >> v[1]
        elif op == "shl.b32":
            out = (v[0] << v[1]) & 0xFFFFFFFF
        elif op == "mov.b32":
            out = v[0]
        elif op == "prmt.b32":
            table = v[0] | v[1] << 32
            out = 0
            for i in range(4):
                nibble = v[2] >> 4 * i & 0xF
                byte = table >> 8 * (nibble & 7) & 0xFF
                out |= (0xFF if byte & 0x80 else 0) << 8 * i if nibble & 8 else byte << 8 * i
        elif op == "lop3.b32":
            out = 0
            for bit in range(32):
                index = (v[0] >> bit & 1) << 2 | (v[1] >> bit & 1) << 1 | (v[2] >> bit & 1)
                out |= (v[3] >> index & 1) << bit
        elif op == "fma.rn.bf16x2":
            halves = [bf16_bits(bf16(v[0] >> h & 0xFFFF) * bf16(v[1] >> h & 0xFFFF) + bf16(v[2] >> h & 0xFFFF)) for h in (0, 16)]
            out = halves[0] | halves[1] << 16
        else:
            raise AssertionError(f"no model of {op}")
        regs[dest] = out
    return regs


def _words_and_expected(scale: torch.Tensor):
    """The 256 bytes as 64 little-endian words, and each byte's (low, high) code values times scale."""
    packed = torch.arange(256, dtype=torch.uint8)
    expected = ref.dequantize_nvfp4(packed.view(16, 16), scale.repeat(16, 2), torch.ones(16)).view(256, 2)
    words = [int.from_bytes(bytes(packed[4 * w : 4 * w + 4].tolist()), "little") for w in range(64)]
    return words, expected


def _assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what) -> None:
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want)), what


def test_bf16_decode_asm_of_every_byte_and_scale() -> None:
    # The tensor-core paths' decode (DECODE_BF16_ASM_LINES; the interpreter cannot run inline
    # PTX) on all 256 bytes, four to a register, with scales from e4m3's smallest subnormal to
    # 448: each code's value times its scale in bf16, exactly, -0 included, in the outputs' order.
    for scale in torch.tensor([2.0**-9, 0.375, 1.0, 1.75, 13.0, 448.0]).to(E4M3):
        words, expected = _words_and_expected(scale)
        expected = expected.bfloat16()
        scale_pair = torch.tensor([scale.float().item()] * 2).bfloat16().view(torch.int32).item() & 0xFFFFFFFF
        for index, word in enumerate(words):
            regs = _run_ptx(fast.DECODE_BF16_ASM_LINES, {"$4": word, "$5": scale_pair, "$6": scale_pair})
            got = torch.tensor([regs[f"${i}"] for i in range(4)], dtype=torch.int64).to(torch.int32).view(torch.bfloat16)
            want = expected[4 * index : 4 * index + 4]
            _assert_bits_equal(got[:4], want[:, 0], (float(scale), index))  # $0, $1: low codes of bytes 0-1, 2-3
            _assert_bits_equal(got[4:], want[:, 1], (float(scale), index))  # $2, $3: high codes


@pytest.mark.slow
def test_tensor_core_kernels_build_with_the_decode_asm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensor-core NVFP4 kernels (this GEMV's DOT path, whole and split over K, the GEMM),
    recorded on CPU tensors, built for sm_90 with the PTX decode on as a launch on a GPU sets it:
    ptxas takes the instructions and each kernel holds them; the split sum and the prefill's
    dequantization build beside them."""
    from triton.runtime.jit import JITFunction

    from tests.kernels.test_pdl_launch import _ptx, compiled_kernel_module

    modules = {name: compiled_kernel_module(monkeypatch, f"ninfer.kernels.{name}.triton") for name in ("nvfp4_gemv", "nvfp4_gemm")}
    recorded: list = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kwargs: recorded.append((self, args, kwargs)))
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (256, 512), dtype=torch.uint8, generator=gen)
    scales = torch.rand(256, 64, generator=gen).to(E4M3)
    row_scale = torch.rand(256, generator=gen)
    x = torch.randn(4, 1024, generator=gen).bfloat16()
    dot = Config(64, 128, num_warps=4, use_dot=True, num_stages=2)
    modules["nvfp4_gemv"].gemv_nvfp4(x, codes, scales, row_scale, config=dot)
    modules["nvfp4_gemv"].gemv_nvfp4(x, codes, scales, row_scale, config=dot._replace(split_k=2))
    modules["nvfp4_gemm"].nvfp4_matmul(torch.randn(64, 1024, generator=gen).bfloat16(), codes, scales, row_scale)
    # From DEQUANTIZED_MIN_ROWS rows: the dequantization kernel (then a matmul of its unwritten output).
    many_rows = modules["nvfp4_gemm"].DEQUANTIZED_MIN_ROWS
    modules["nvfp4_gemm"].nvfp4_matmul(torch.randn(many_rows, 1024, generator=gen).bfloat16(), codes, scales, row_scale)
    flags = {"_nvfp4_dot_kernel": "DECODE_BY_ASM", "_nvfp4_gemm_kernel": "DECODE_BY_ASM"}
    built = []
    for fn, args, kwargs in recorded:
        name = fn.fn.__name__
        if name not in flags:
            assert _ptx(fn, args, kwargs), name  # the split sum and the dequantization build too
            built.append(name)
            continue
        assert kwargs[flags[name]] is False  # CPU tensors: the interpreter's decode
        ptx = _ptx(fn, args, {**kwargs, flags[name]: True})
        assert "prmt.b32 l01, 0xC0800000, 0xC0804000, m;" in ptx and "fma.rn.bf16x2" in ptx, name
        built.append(f"{name}, split" if kwargs.get("SPLIT") else name)
    assert built == ["_nvfp4_dot_kernel", "_nvfp4_dot_kernel, split", "_split_sum_kernel", "_nvfp4_gemm_kernel",
                     "_dequantize_kernel"]


@interpreter_only
def test_invalid_inputs() -> None:
    packed, block_scale, row_scale = random_weights(N, 64, seed=50)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        fast.gemv_nvfp4(torch.randn(2, 40), packed[:, :20], block_scale[:, :2], row_scale)
    with pytest.raises(ValueError, match="weight"):
        fast.gemv_nvfp4(x, packed.view(torch.int8), block_scale, row_scale)
    with pytest.raises(ValueError, match="weight"):
        fast.gemv_nvfp4(x, packed[:, :16], block_scale, row_scale)
    with pytest.raises(ValueError, match="block_scale"):
        fast.gemv_nvfp4(x, packed, block_scale.float(), row_scale)
    with pytest.raises(ValueError, match="block_scale"):
        fast.gemv_nvfp4(x, packed, block_scale[:, :2], row_scale)
    with pytest.raises(ValueError, match="row_scale"):
        fast.gemv_nvfp4(x, packed, block_scale, row_scale[:-1])
    with pytest.raises(ValueError, match="bias"):
        fast.gemv_nvfp4(x, packed, block_scale, row_scale, torch.zeros(N + 1))
    with pytest.raises(ValueError, match="config"):
        fast.gemv_nvfp4(x, packed, block_scale, row_scale, config=Config(block_n=4, block_k=64, vec_bytes=16))


@interpreter_only
def test_beyond_max_rows_and_empty_shapes() -> None:
    packed, block_scale, row_scale = random_weights(N, 32, seed=60)
    x, bias = random_activations(MAX_ROWS + 1, N, 32, torch.bfloat16, seed=60)
    expected = ref.gemv_nvfp4(x, packed, block_scale, row_scale, bias)
    assert torch.equal(fast.gemv_nvfp4(x, packed, block_scale, row_scale, bias), expected)
    assert fast.gemv_nvfp4(x[:0], packed, block_scale, row_scale).shape == (0, N)
    empty = fast.gemv_nvfp4(x[:2], packed[:0], block_scale[:0], row_scale[:0])
    assert empty.shape == (2, 0)
    no_k = fast.gemv_nvfp4(x[:2, :0], packed[:, :0], block_scale[:, :0], row_scale, bias)
    assert torch.equal(no_k, bias.expand(2, N))


SHAPES_27B = {
    "27b_gdn_in_proj": (16480, 5120),
    "27b_gdn_out_proj": (5120, 6144),
    "27b_attn_qkv": (14336, 5120),
    "27b_mlp_gate_up": (34816, 5120),
    "27b_mlp_down": (5120, 17408),
}


def test_heuristic_on_real_shapes() -> None:
    for n, k in SHAPES_27B.values():
        assert not fast._config(1, n, k, 132, dot=True).use_dot  # one row: the FMA path
        for m in range(2, MAX_ROWS + 1):
            dot = fast._config(m, n, k, 132, dot=True)  # bf16 x: the tensor-core path from 2 rows
            assert dot.use_dot and k % dot.block_k == 0 and dot.block_n % 16 == 0
            programs = -(-n // dot.block_n) * dot.split_k
            assert programs <= fast.DOT_TARGET_PROGRAMS_PER_SM * 132  # within the target ...
            # ... and one more split would pass it or leave under 4 steps per split
            assert 2 * programs > fast.DOT_TARGET_PROGRAMS_PER_SM * 132 or k // (2 * dot.split_k * dot.block_k) < 4
            assert k // (dot.split_k * dot.block_k) >= 4  # at least 4 steps per split
        for m in range(1, MAX_ROWS + 1):
            cfg = fast._config(m, n, k, 132)
            vec = 2 * cfg.vec_bytes
            assert 16 % vec == 0 and k % cfg.block_k == 0  # whole vectors in a block, no masked step
            assert cfg.block_k == vec * 32 * cfg.num_warps  # one vector per thread and row per step
            assert -(-n // cfg.block_n) >= 4 * 132  # at least 4 programs per SM
    # The measured bests at 8 rows on an H100 (docs/kernels.md "NVFP4 GEMV").
    assert fast._config(8, *SHAPES_27B["27b_mlp_down"], 132, dot=True).split_k == 8
    assert fast._config(8, *SHAPES_27B["27b_gdn_in_proj"], 132, dot=True).split_k == 2
    assert fast._config(1, 5120, 5120, 132) is fast._config(1, 5120, 5120, 132)


# --- compiled on the GPU ---------------------------------------------------------------------


def _exact_fp32(x, packed, block_scale, row_scale, bias=None) -> torch.Tensor:
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out = x.float() @ ref.dequantize_nvfp4(packed, block_scale, row_scale).T
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return out if bias is None else out + bias.float()


def _check_gpu(out: torch.Tensor, expected: torch.Tensor) -> None:
    # Both sum in fp32 (other orders, and the kernel scales the block sums where the reference
    # scales each weight), then one rounding to bf16: within half a bf16 unit (2^-8 relative,
    # with margin for the fp32 order) plus 1e-3 of the largest output for outputs near zero.
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-3 * expected.abs().max().item())


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
                cache[name] = ref.quantize_nvfp4(w)
            return cache[name]

        return get

    @pytest.mark.parametrize("name", list(SHAPES_27B))
    @pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
    def test_matches_reference(self, name: str, m: int, weights) -> None:
        n, k = SHAPES_27B[name]
        packed, block_scale, row_scale = weights(name)
        x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).bfloat16()
        out = nvfp4_op.gemv_nvfp4(x, packed, block_scale, row_scale)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        _check_gpu(out, _exact_fp32(x, packed, block_scale, row_scale))
        # The dispatcher's choice for CUDA tensors, and the same bits on every run.
        assert torch.equal(fast.gemv_nvfp4(x, packed, block_scale, row_scale), out)

    @pytest.mark.parametrize("name", list(SHAPES_27B))
    @pytest.mark.parametrize("m", [1, 2])
    def test_double_buffered_fma_gives_the_same_bits(self, name: str, m: int, weights) -> None:
        # The same sums in the same order, each step's loads issued a step earlier.
        packed, block_scale, row_scale = weights(name)
        n, k = SHAPES_27B[name]
        x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).bfloat16()
        single = fast._config(m, n, k, fast.device_sms(x.device))._replace(use_dot=False, double_buffer=False)
        out = fast.gemv_nvfp4(x, packed, block_scale, row_scale, config=single)
        _check_gpu(out, _exact_fp32(x, packed, block_scale, row_scale))
        doubled = fast.gemv_nvfp4(x, packed, block_scale, row_scale, config=single._replace(double_buffer=True))
        assert torch.equal(doubled, out)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    @pytest.mark.parametrize("m", [3, 16])
    def test_bias_strided_rows_and_random_scales(self, dtype: torch.dtype, m: int) -> None:
        # Random codes and scales (zero and subnormal blocks) at a real shape, x rows strided;
        # row scales cut by 2^-12 to keep fp16 sums of 6144 terms in range.
        n, k = SHAPES_27B["27b_gdn_out_proj"]
        packed, block_scale, row_scale = random_weights(n, k, seed=m, device="cuda")
        row_scale = row_scale * 2**-12
        gen = torch.Generator("cuda").manual_seed(100 + m)
        x = torch.randn(m, k + 64, device="cuda", generator=gen).to(dtype)[:, :k]
        bias = torch.randn(n, device="cuda", generator=gen).to(dtype)
        out = nvfp4_op.gemv_nvfp4(x, packed, block_scale, row_scale, bias)
        expected = _exact_fp32(x, packed, block_scale, row_scale, bias)
        if dtype == torch.bfloat16:
            _check_gpu(out, expected)
        else:
            torch.testing.assert_close(out.float(), expected, rtol=ULP[dtype] / 2 + 1e-5, atol=1e-5 * expected.abs().max().item())

    @pytest.mark.parametrize("name", list(SHAPES_27B))
    @pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
    def test_dot_path_matches_reference(self, name: str, m: int, weights) -> None:
        n, k = SHAPES_27B[name]
        packed, block_scale, row_scale = weights(name)
        x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).bfloat16()
        for config in (fast.Config(64, 128, num_warps=4, use_dot=True, num_stages=3),
                       fast.Config(32, 256, num_warps=2, use_dot=True, num_stages=4),
                       fast.Config(32, 128, num_warps=2, use_dot=True, num_stages=4, split_k=4)):
            out = fast.gemv_nvfp4(x, packed, block_scale, row_scale, config=config)
            _check_gpu(out, _exact_fp32(x, packed, block_scale, row_scale))

    def test_cuda_graph_replay(self, weights) -> None:
        packed, block_scale, row_scale = weights("27b_mlp_down")
        x = torch.randn(2, 17408, device="cuda").bfloat16()
        eager = fast.gemv_nvfp4(x, packed, block_scale, row_scale)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fast.gemv_nvfp4(x, packed, block_scale, row_scale)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, fast.gemv_nvfp4(x, packed, block_scale, row_scale))
        assert not torch.equal(captured, eager)
