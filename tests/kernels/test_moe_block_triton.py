"""The fused MoE block (kernels/moe_block) under Triton's CPU interpreter vs ref.py.

The compiled kernels at the 35B-A3B shapes, and in a CUDA graph, are tested in
tests/gpu/test_moe.py.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.moe.ref import quantize_nvfp4_experts
from ninfer.kernels.moe_block import ref
from tests.kernels.interpreter import bf16_round_to_nearest_even, cpu_interpreter, interpreted  # noqa: F401

fast = interpreted("ninfer.kernels.moe_block.triton")

NUM_EXPERTS, HIDDEN, INTER, SHARED_INTER, TOP_K = 12, 48, 40, 24, 3  # nothing a power of two or a block multiple
SMALL_TILES = ((8, 16, 1), (8, 16, 1))  # several column tiles and K steps at these sizes
SPLIT_TILES = ((8, 16, 1), (8, 16, 1, 3))  # the down stage split over the slots, then summed


def _block(seed: int, num_tokens: int, dtype: torch.dtype = torch.float32, shared: bool = True):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    x = randn(num_tokens, HIDDEN, scale=1.0)
    logits = randn(num_tokens, NUM_EXPERTS, scale=2.0)
    experts = (randn(NUM_EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5), randn(NUM_EXPERTS, HIDDEN, INTER, scale=INTER**-0.5))
    shared_weights = (
        randn(2 * SHARED_INTER, HIDDEN, scale=HIDDEN**-0.5),
        randn(HIDDEN, SHARED_INTER, scale=SHARED_INTER**-0.5),
        randn(1, HIDDEN, scale=HIDDEN**-0.5),
    )
    return x, logits, experts, shared_weights if shared else (None, None, None)


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected.double()).norm() / expected.double().norm()).item()


TILE_IDS = {None: "default-tiles", SMALL_TILES: "small-tiles", SPLIT_TILES: "split-down"}


def _tiles_id(tiles) -> str:
    return TILE_IDS.get(tiles, "row-tiles")


def _covering(tile_options, kinds, many_tokens, few_tokens) -> list:
    """(tiles, kind, tokens) cases: every tile with every kind at the larger token counts (where
    the tiles' column and K loops, slots and splits all run), the smaller counts on the default
    tiles: each pair of options meets, without the whole product (interpreted kernels are slow)."""
    cases = [(tiles, kind, n) for tiles in tile_options for kind in kinds for n in many_tokens]
    cases += [(None, kind, n) for kind in kinds for n in few_tokens]
    return [pytest.param(*case, id=f"{_tiles_id(case[0])}-{case[1]}-{case[2]}") for case in cases]


# 6 tokens: past MAX_TOKENS (the benchmark times it).
@pytest.mark.parametrize("tiles, shared, num_tokens", _covering(TILE_IDS, [True, False], (4, 6), (1, 2)))
def test_moe_block_matches_reference_fp32(num_tokens: int, shared: bool, tiles) -> None:
    x, logits, experts, shared_weights = _block(seed=num_tokens, num_tokens=num_tokens, shared=shared)
    out = fast.moe_block(x, logits, TOP_K, True, *experts, *shared_weights, tiles=tiles)
    expected = ref.moe_block(x.double(), logits, TOP_K, True, *(w.double() for w in experts),
                             *(None if w is None else w.double() for w in shared_weights))  # fmt: skip
    assert out.shape == x.shape and out.dtype == x.dtype
    assert _relative_error(out, expected) < 1e-5  # fp32 accumulation throughout


def test_every_token_on_one_expert() -> None:
    """Tokens that all choose the same expert each stream it (no owner of a group to miss)."""
    x, logits, experts, shared_weights = _block(seed=5, num_tokens=4)
    logits[:, 7] += 20
    out = fast.moe_block(x, logits, TOP_K, False, *experts, *shared_weights, tiles=SMALL_TILES)
    expected = ref.moe_block(x.double(), logits, TOP_K, False, *(w.double() for w in experts), *(w.double() for w in shared_weights))
    assert _relative_error(out, expected) < 1e-5


@pytest.mark.usefixtures("bf16_round_to_nearest_even")
def test_moe_block_bf16_close_to_reference() -> None:
    """bf16 as the model runs it: the kernel sums in fp32 and rounds once where the reference
    rounds every product, weighted output and sum; both against a float64 evaluation."""
    x, logits, experts, shared_weights = _block(seed=11, num_tokens=2, dtype=torch.bfloat16)
    out = fast.moe_block(x, logits, TOP_K, True, *experts, *shared_weights)
    exact = ref.moe_block(x.double(), logits, TOP_K, True, *(w.double() for w in experts), *(w.double() for w in shared_weights))
    reference = ref.moe_block(x, logits, TOP_K, True, *experts, *shared_weights)
    assert out.dtype == torch.bfloat16
    assert _relative_error(out, exact) <= max(1e-2, 1.5 * _relative_error(reference, exact))


def test_refuses_what_it_does_not_fuse() -> None:
    x, logits, experts, shared_weights = _block(seed=3, num_tokens=1)
    with pytest.raises(ValueError, match="together"):
        fast.moe_block(x, logits, TOP_K, True, *experts, shared_weights[0], None, None)
    with pytest.raises(ValueError, match="quantized"):
        fast.moe_block(x, logits, TOP_K, True, experts[0].bfloat16(), experts[1], *shared_weights)


FP8 = torch.float8_e4m3fn
# FP8 shapes: H = 200 (a partial second 128-column K block), I = 96 (up rows straddle the gate's
# 128-row block; the down K one partial block), S = 80.
FP8_HIDDEN, FP8_INTER, FP8_SHARED = 200, 96, 80
SCALE_LAYOUTS = {"row": None, "block": 128, "row_block": 1}  # weight rows per scale row (None: one per row)


def _fp8(lead: tuple[int, ...], rows: int, cols: int, rows_per_block: int | None, gen: torch.Generator):
    """e4m3 codes over the finite range and fp32 scales making the weights ~N(0, 1/cols)."""
    codes = (torch.randn(*lead, rows, cols, generator=gen) * 64).clamp(-448, 448).to(FP8)
    if rows_per_block is None:
        shape = (*lead, rows)
    else:
        shape = (*lead, -(-rows // rows_per_block), -(-cols // 128))
    scale = 2.0 ** (torch.empty(shape).uniform_(-1, 1, generator=gen) + torch.tensor(cols**-0.5 / 64).log2())
    return codes, scale


@pytest.mark.parametrize("experts_layout", list(SCALE_LAYOUTS))
@pytest.mark.parametrize("shared_layout", ["row", "row_block", "unquantized"])
def test_fp8_experts_and_shared_expert(experts_layout: str, shared_layout: str) -> None:
    """e4m3 experts in each layout of kernels/moe/ref.py; the shared expert e4m3 per channel or
    in row blocks, or unquantized in x's dtype beside FP8 experts."""
    gen = torch.Generator().manual_seed(len(experts_layout) * 7 + len(shared_layout))
    num_tokens = 3
    x = torch.randn(num_tokens, FP8_HIDDEN, generator=gen)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen) * 2
    rows = SCALE_LAYOUTS[experts_layout]
    gate_up, gate_up_scale = _fp8((NUM_EXPERTS,), 2 * FP8_INTER, FP8_HIDDEN, rows, gen)
    down, down_scale = _fp8((NUM_EXPERTS,), FP8_HIDDEN, FP8_INTER, rows, gen)
    if shared_layout == "unquantized":
        shared_gate_up = torch.randn(2 * FP8_SHARED, FP8_HIDDEN, generator=gen) * FP8_HIDDEN**-0.5
        shared_down = torch.randn(FP8_HIDDEN, FP8_SHARED, generator=gen) * FP8_SHARED**-0.5
        shared_scales = (None, None)
    else:
        shared_rows = SCALE_LAYOUTS[shared_layout]
        shared_gate_up, up_scale = _fp8((), 2 * FP8_SHARED, FP8_HIDDEN, shared_rows, gen)
        shared_down, dn_scale = _fp8((), FP8_HIDDEN, FP8_SHARED, shared_rows, gen)
        shared_scales = (up_scale, dn_scale)
    shared_gate = torch.randn(1, FP8_HIDDEN, generator=gen) * FP8_HIDDEN**-0.5
    args = (TOP_K, True, gate_up, down, shared_gate_up, shared_down, shared_gate, gate_up_scale, down_scale, *shared_scales)
    out = fast.moe_block(x, logits, *args)
    doubled = [w if w.dtype == FP8 or w is logits else w.double() for w in (shared_gate_up, shared_down, shared_gate)]
    expected = ref.moe_block(x.double(), logits, TOP_K, True, gate_up, down, *doubled, gate_up_scale, down_scale, *shared_scales)
    assert _relative_error(out, expected) < 1e-5


def test_fp8_weights_need_their_scales() -> None:
    gen = torch.Generator().manual_seed(0)
    x, logits, experts, shared_weights = _block(seed=1, num_tokens=1)
    gate_up, gate_up_scale = _fp8((NUM_EXPERTS,), 2 * INTER, HIDDEN, None, gen)
    with pytest.raises(ValueError, match="scales"):
        fast.moe_block(x, logits, TOP_K, True, gate_up, experts[1], *shared_weights)
    with pytest.raises(ValueError, match="scales"):
        fast.moe_block(x, logits, TOP_K, True, *experts, *shared_weights, gate_up_scale)


@pytest.mark.parametrize("quantized", [None, "fp8-rows", "fp8-blocks", "nvfp4"])
def test_sparse_moe_runs_decode_blocks_on_the_fused_kernels(quantized: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """SparseMoE hands decode-sized blocks (and their FP8 or NVFP4 scales) to moe_block in its
    argument order: the interpreted kernels give what the layer's separate ops give (nvfp4: the
    experts Nvfp4Experts, the shared expert's projections Nvfp4Linear, router and shared gate kept)."""
    from torch import nn

    from ninfer.models.config import ModelConfig
    from ninfer.models.layers import moe as moe_layer
    from ninfer.models.quant.fp8 import quantize_fp8_, quantize_fp8_blocks_
    from ninfer.models.quant.nvfp4 import quantize_nvfp4_

    hidden = FP8_HIDDEN + 8 if quantized == "nvfp4" else FP8_HIDDEN  # NVFP4: K a multiple of 16
    config = ModelConfig(
        model_type="qwen3_5_moe_text", family="qwen3_5", vocab_size=32, hidden_size=hidden, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=0, num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K, moe_intermediate_size=FP8_INTER, shared_expert_intermediate_size=FP8_SHARED,
    )  # fmt: skip
    torch.manual_seed(0)
    holder = nn.Module()
    holder.mlp = moe_layer.SparseMoE(config)
    with torch.no_grad():
        for param in holder.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5)
    if quantized == "fp8-rows":
        quantize_fp8_(holder)
    elif quantized == "fp8-blocks":
        quantize_fp8_blocks_(holder)
    elif quantized == "nvfp4":
        assert quantize_nvfp4_(holder) == 3
    calls = []

    def interpreted_block(*args):
        calls.append(args)
        return fast.moe_block(*args)

    x = torch.randn(3, hidden)
    with torch.no_grad():
        monkeypatch.setattr(moe_layer, "moe_block", interpreted_block)
        fused = holder.mlp(x)
        monkeypatch.setattr(moe_layer, "MAX_TOKENS", 0)
        separate = holder.mlp(x)
    assert len(calls) == 1
    assert (calls[0][9] is not None) == (quantized is not None)  # the experts' scales
    assert _relative_error(fused, separate) < 1e-5


# NVFP4 shapes: the K's (H for gate_up, I and S for down) multiples of 16 (NVFP4's block) and of
# no BLOCK_K here; at the smallest NVFP4 step (32 codes, one vector) H and S end in half a vector.
NVFP4_HIDDEN, NVFP4_INTER, NVFP4_SHARED = 48, 32, 48
# Tiles whose rows lie partly in registers, partly over threads (up: 2 x 4 rows, down 2 x 8).
NVFP4_ROW_TILES = ((8, 256, 1), (16, 128, 1, 3))


def _nvfp4_block(seed: int, num_tokens: int, experts: str, shared: str | None, dtype: torch.dtype = torch.float32):
    """(x, logits, the moe_block weight arguments after top_k and renormalize): experts "nvfp4" or
    "fp8" (row blocks), the shared expert "nvfp4", "16-bit" (x's dtype) or None."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5

    x = torch.randn(num_tokens, NVFP4_HIDDEN, generator=gen).to(dtype)
    logits = (torch.randn(num_tokens, NUM_EXPERTS, generator=gen) * 2).to(dtype)
    if experts == "nvfp4":
        gate_up, gate_up_scale = quantize_nvfp4_experts(randn(NUM_EXPERTS, 2 * NVFP4_INTER, NVFP4_HIDDEN))
        down, down_scale = quantize_nvfp4_experts(randn(NUM_EXPERTS, NVFP4_HIDDEN, NVFP4_INTER))
    else:
        gate_up, gate_up_scale = _fp8((NUM_EXPERTS,), 2 * NVFP4_INTER, NVFP4_HIDDEN, 1, gen)
        down, down_scale = _fp8((NUM_EXPERTS,), NVFP4_HIDDEN, NVFP4_INTER, 1, gen)
    if shared is None:
        return x, logits, (gate_up, down, None, None, None, gate_up_scale, down_scale, None, None)
    shared_gate_up, shared_down = randn(2 * NVFP4_SHARED, NVFP4_HIDDEN), randn(NVFP4_HIDDEN, NVFP4_SHARED)
    if shared == "nvfp4":
        (shared_gate_up, shared_gate_up_scale), (shared_down, shared_down_scale) = quantize_nvfp4_experts(shared_gate_up), quantize_nvfp4_experts(shared_down)
    else:
        shared_gate_up, shared_down = shared_gate_up.to(dtype), shared_down.to(dtype)
        shared_gate_up_scale = shared_down_scale = None
    shared_gate = randn(1, NVFP4_HIDDEN).to(dtype)
    return x, logits, (gate_up, down, shared_gate_up, shared_down, shared_gate,
                       gate_up_scale, down_scale, shared_gate_up_scale, shared_down_scale)  # fmt: skip


def _double(weights: tuple) -> tuple:
    """The weights in x's dtype in float64 (the reference's exact evaluation); codes and scales as they are."""
    return tuple(
        w.double() if i < 5 and isinstance(w, torch.Tensor) and w.is_floating_point() and w.dtype != FP8 else w
        for i, w in enumerate(weights)
    )


NVFP4_MIXES = {"nvfp4-experts-16bit-shared": ("nvfp4", "16-bit"), "nvfp4": ("nvfp4", "nvfp4"),
               "fp8-experts-nvfp4-shared": ("fp8", "nvfp4"), "nvfp4-no-shared": ("nvfp4", None)}


@pytest.mark.parametrize("tiles, mix, num_tokens", _covering([*TILE_IDS, NVFP4_ROW_TILES], NVFP4_MIXES, (4,), (1, 2)))
def test_nvfp4_matches_reference_fp32(num_tokens: int, mix: str, tiles) -> None:
    """NVFP4 matrices (decoded exactly) beside 16-bit and FP8 ones: fp32 sums against float64."""
    experts, shared = NVFP4_MIXES[mix]
    x, logits, weights = _nvfp4_block(seed=num_tokens, num_tokens=num_tokens, experts=experts, shared=shared)
    out = fast.moe_block(x, logits, TOP_K, True, *weights, tiles=tiles)
    expected = ref.moe_block(x.double(), logits, TOP_K, True, *_double(weights))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert _relative_error(out, expected) < 1e-5


@pytest.mark.usefixtures("bf16_round_to_nearest_even")
def test_nvfp4_bf16_close_to_reference() -> None:
    """bf16 x with NVFP4 experts and shared expert, as an NVFP4 checkpoint runs: no further from a
    float64 evaluation of the same codes than the reference's rounded products."""
    x, logits, weights = _nvfp4_block(seed=11, num_tokens=2, experts="nvfp4", shared="nvfp4", dtype=torch.bfloat16)
    out = fast.moe_block(x, logits, TOP_K, True, *weights)
    exact = ref.moe_block(x.double(), logits, TOP_K, True, *_double(weights))
    reference = ref.moe_block(x, logits, TOP_K, True, *weights)
    assert out.dtype == torch.bfloat16
    assert _relative_error(out, exact) <= max(1e-2, 1.5 * _relative_error(reference, exact))


def test_nvfp4_operands_are_checked() -> None:
    """Misshapen NVFP4 operands raise ValueError naming the operand (the kernels would read out of bounds)."""
    x, logits, weights = _nvfp4_block(seed=2, num_tokens=1, experts="nvfp4", shared="nvfp4")
    gate_up, down, shared_gate_up, shared_down, shared_gate, gate_up_scale, down_scale, up_scale, dn_scale = weights

    def call(**changes):
        args = dict(gate_up_proj=gate_up, down_proj=down, shared_gate_up=shared_gate_up, shared_down=shared_down,
                    shared_gate=shared_gate, gate_up_scale=gate_up_scale, down_scale=down_scale,
                    shared_gate_up_scale=up_scale, shared_down_scale=dn_scale)  # fmt: skip
        return fast.moe_block(x, logits, TOP_K, True, **{**args, **changes})

    with pytest.raises(ValueError, match="gate_up_scale block_scale"):
        call(gate_up_scale=(gate_up_scale[0][:, :, :-1], gate_up_scale[1]))  # a block column short
    with pytest.raises(ValueError, match="shared_down_scale block_scale"):
        call(shared_down_scale=(dn_scale[0].float(), dn_scale[1]))  # not e4m3
    with pytest.raises(ValueError, match="down_scale row_scale"):
        call(down_scale=(down_scale[0], down_scale[1][:, :-1]))
    with pytest.raises(ValueError, match="down_scale: .*pair"):
        call(down_scale=(down_scale[0], None))  # the row scale missing
    with pytest.raises(ValueError, match="shared_gate_up_scale: .*pair"):
        call(shared_gate_up_scale=up_scale[0])  # a block scale alone
    with pytest.raises(ValueError, match="gate_up_proj: .*uint8"):
        call(gate_up_proj=gate_up.view(torch.int8))  # codes of another dtype with a pair
    with pytest.raises(ValueError, match="shared_down: .*codes"):
        call(shared_down=shared_down[:, :-1].contiguous())  # not K/2 bytes a row
    with pytest.raises(ValueError, match="down_proj: NVFP4 needs K a multiple of 16"):
        narrow = (gate_up[:, :16].contiguous(), (gate_up_scale[0][:, :16], gate_up_scale[1][:, :16]))  # I = 8
        fast.moe_block(x, logits, TOP_K, True, narrow[0], down[:, :, :4].contiguous(), gate_up_scale=narrow[1],
                       down_scale=(down_scale[0][:, :, :0], down_scale[1]))  # fmt: skip


@pytest.mark.slow
def test_nvfp4_kernels_build_for_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NVFP4 kernels at the 35B-A3B shapes and default tiles, built for sm_90 as a launch on an
    H100 would build them (Triton compiles on a CPU machine; the GPU run is tests/gpu/test_moe.py):
    no register spills, the codes read as 16-byte vectors, and x put in the weights' layout (no
    per-step layout conversion through shared memory: a few stores outside the K loops at most)."""
    import importlib
    import re
    import subprocess
    import sys

    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    # Modules built for compilation, not the interpreter (tests/kernels/test_pdl_launch.py's fixture).
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    helpers = ("pdl", "l2_prefetch", "activation.triton", "gemv.triton", "moe.triton", "nvfp4_gemv.triton", "moe_block.triton")
    for name in helpers:
        monkeypatch.delitem(sys.modules, f"ninfer.kernels.{name}", raising=False)
    block = importlib.import_module("ninfer.kernels.moe_block.triton")
    launches = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs)))
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, top_k = 16, 2048, 512, 8

    def nvfp4(*shape):  # codes and scales of any value: only the build is checked
        codes = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), dtype=torch.uint8, generator=gen)
        return codes, (torch.rand(*shape[:-1], shape[-1] // 16, generator=gen).to(FP8), torch.rand(*shape[:-1], generator=gen))

    (gate_up, gate_up_scale), (down, down_scale) = nvfp4(experts, 2 * inter, hidden), nvfp4(experts, hidden, inter)
    (shared_gate_up, up_scale), (shared_down, dn_scale) = nvfp4(2 * inter, hidden), nvfp4(hidden, inter)
    x, logits = torch.randn(1, hidden).bfloat16(), torch.randn(1, experts).bfloat16()
    block.moe_block(x, logits, top_k, True, gate_up, down, shared_gate_up, shared_down, torch.randn(1, hidden).bfloat16(),
                    gate_up_scale, down_scale, up_scale, dn_scale)  # fmt: skip
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    built = {}
    for fn, args, kwargs in launches:
        if fn.fn.__name__ in ("_block_up_kernel", "_block_down_kernel"):
            # The JIT's own specialization (pointer alignment, integers divisible by 16), as run() packs it.
            bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
            kernel = compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
            log = subprocess.run([knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", "-", "-o", "/dev/null"],
                                 input=kernel.asm["ptx"], capture_output=True, text=True, check=True).stderr  # fmt: skip
            built[fn.fn.__name__] = kernel.asm["ptx"], log
    assert set(built) == {"_block_up_kernel", "_block_down_kernel"}
    for name, (ptx, log) in built.items():
        registers, spill_stores, spill_loads = (int(re.search(pattern, log).group(1)) for pattern in (
            r"Used (\d+) registers", r"(\d+) bytes spill stores", r"(\d+) bytes spill loads"))  # fmt: skip
        print(f"{name}: {registers} registers, {spill_stores} + {spill_loads} bytes spilled")
        assert spill_stores == spill_loads == 0, (name, log)
        assert "ld.global.v4.b32" in ptx, name
        assert ptx.count("st.shared") <= 4, name
