"""The fused MoE block (kernels/moe_block) under Triton's CPU interpreter vs ref.py.

The compiled kernels at the 35B-A3B shapes, and in a CUDA graph, are tested in
tests/gpu/test_moe.py.
"""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("num_tokens", [1, 2, 4, 6])  # 6: past MAX_TOKENS (the benchmark times it)
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("tiles", [None, SMALL_TILES, SPLIT_TILES], ids=["default-tiles", "small-tiles", "split-down"])
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


@pytest.mark.parametrize("quantized", [None, "fp8-rows", "fp8-blocks"])
def test_sparse_moe_runs_decode_blocks_on_the_fused_kernels(quantized: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """SparseMoE hands decode-sized blocks (and their FP8 scales) to moe_block in its argument
    order: the interpreted kernels give what the layer's separate ops give."""
    from torch import nn

    from ninfer.models.config import ModelConfig
    from ninfer.models.layers import moe as moe_layer
    from ninfer.models.quant.fp8 import quantize_fp8_, quantize_fp8_blocks_

    config = ModelConfig(
        model_type="qwen3_5_moe_text", family="qwen3_5", vocab_size=32, hidden_size=FP8_HIDDEN, num_hidden_layers=1,
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
    calls = []

    def interpreted_block(*args):
        calls.append(args)
        return fast.moe_block(*args)

    x = torch.randn(3, FP8_HIDDEN)
    with torch.no_grad():
        monkeypatch.setattr(moe_layer, "moe_block", interpreted_block)
        fused = holder.mlp(x)
        monkeypatch.setattr(moe_layer, "MAX_TOKENS", 0)
        separate = holder.mlp(x)
    assert len(calls) == 1
    assert (calls[0][9] is not None) == (quantized is not None)  # the experts' scales
    assert _relative_error(fused, separate) < 1e-5
