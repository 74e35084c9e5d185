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


@pytest.mark.parametrize("num_tokens", [1, 2, 4])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("tiles", [None, SMALL_TILES], ids=["default-tiles", "small-tiles"])
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
    x, logits, experts, shared_weights = _block(seed=3, num_tokens=ref.MAX_TOKENS + 1)
    with pytest.raises(ValueError, match="up to"):
        fast.moe_block(x, logits, TOP_K, True, *experts, *shared_weights)
    x, logits, experts, shared_weights = _block(seed=3, num_tokens=1)
    with pytest.raises(ValueError, match="together"):
        fast.moe_block(x, logits, TOP_K, True, *experts, shared_weights[0], None, None)
    with pytest.raises(ValueError, match="quantized"):
        fast.moe_block(x, logits, TOP_K, True, experts[0].bfloat16(), experts[1], *shared_weights)
