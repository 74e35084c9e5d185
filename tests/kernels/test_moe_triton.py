"""Our Triton MoE kernels (fused router, grouped expert GEMM in decode and prefill modes)
under Triton's CPU interpreter vs ref.py.

The compiled kernels at the 35B-A3B shapes are tested in tests/gpu/test_moe.py.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.moe import ref
from tests.kernels.interpreter import cpu_interpreter, interpreted  # noqa: F401 (autouse fixture)

fast = interpreted("ninfer.kernels.moe.triton")


NUM_EXPERTS, HIDDEN, INTER, TOP_K = 12, 48, 40, 3  # nothing a power of two or a block multiple


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5
    down = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) * INTER**-0.5
    return gate_up, down


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_reference(renormalize: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(7, NUM_EXPERTS, generator=gen) * 2  # fp32: no ties
    weights, ids = fast.route(logits, TOP_K, renormalize)
    expected_weights, expected_ids = ref.route(logits, TOP_K, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == logits.dtype
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 4, 60])  # 4 * 3 pairs: decode mode; 60 * 3 > 128: prefill mode
def test_fused_experts_matches_reference(num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    gate_up, down = _weights(seed=100 + num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen)
    if num_tokens == 4:
        logits[:, 5] += 10  # every token picks expert 5: one owner must serve all four rows
    weights, ids = ref.route(logits, TOP_K, True)
    out = fast.fused_experts(x, weights, ids, gate_up, down)
    expected = ref.fused_experts(x.double(), weights.double(), ids, gate_up.double(), down.double())
    assert out.shape == x.shape and out.dtype == x.dtype
    assert _relative_error(out, expected) < 1e-5  # fp32 accumulation throughout


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_prefill_block_sizes_agree(block_m: int) -> None:
    gen = torch.Generator().manual_seed(block_m)
    gate_up, down = _weights(seed=7)
    x = torch.randn(50, HIDDEN, generator=gen)
    weights, ids = ref.route(torch.randn(50, NUM_EXPERTS, generator=gen), TOP_K, True)
    out = fast.fused_experts(x, weights, ids, gate_up, down, block_m=block_m)
    expected = ref.fused_experts(x.double(), weights.double(), ids, gate_up.double(), down.double())
    assert _relative_error(out, expected) < 1e-5


def test_sort_by_expert_pads_each_group_to_whole_blocks() -> None:
    ids = torch.tensor([[3, 0], [3, 7], [0, 3]])
    sorted_pairs, block_expert, num_blocks = fast._sort_by_expert(ids, num_experts=8, block_m=4)
    num_pairs = ids.numel()
    assert sorted_pairs.numel() == num_blocks * 4
    flat = ids.reshape(-1)
    for block in range(num_blocks):
        rows = sorted_pairs[block * 4 : (block + 1) * 4]
        real = rows[rows < num_pairs]
        if block_expert[block] < 0:
            assert real.numel() == 0
        else:
            assert (flat[real] == block_expert[block]).all()
    served = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(served.tolist()) == list(range(num_pairs))  # every pair exactly once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_prefill_matches_reference(dtype: torch.dtype) -> None:
    """The prefill path on torch's grouped GEMM (taken on sm_90+ in bf16), forced on CPU; an
    expert nobody picks (0) and one picked by every token (5) give empty and full groups."""
    gen = torch.Generator().manual_seed(11)
    gate_up, down = _weights(seed=12)
    x = torch.randn(50, HIDDEN, generator=gen)
    logits = torch.randn(50, NUM_EXPERTS, generator=gen)
    logits[:, 0] -= 100
    logits[:, 5] += 100
    weights, ids = ref.route(logits, TOP_K, True)
    assert not (ids == 0).any() and (ids == 5).any(dim=1).all()
    out = fast.fused_experts(x.to(dtype), weights.to(dtype), ids, gate_up.to(dtype), down.to(dtype), grouped_mm=True)
    expected = ref.fused_experts(x.double(), weights.double(), ids, gate_up.double(), down.double())
    assert out.dtype == dtype and out.shape == x.shape
    # fp32: fp32 accumulation throughout; bf16: x, weights, the activation and each expert
    # output rounded to bf16 once (the all-bf16 reference is further off, see tests/gpu)
    assert _relative_error(out, expected) < (1e-5 if dtype == torch.float32 else 2e-2)
    if dtype == torch.float32:  # the same sums as the Triton grouped kernels (their bf16 dots need the GPU)
        triton_out = fast.fused_experts(x, weights, ids, gate_up, down, grouped_mm=False)
        assert _relative_error(out, triton_out) < 1e-6


def test_expert_order_is_a_stable_sort_by_expert() -> None:
    # 3000 pairs: two passes of 2048-pair blocks; expert 0 unused, expert 5 in every token.
    gen = torch.Generator().manual_seed(13)
    ids = torch.randint(1, NUM_EXPERTS, (1000, TOP_K), generator=gen)
    ids[:, 0] = 5
    sorted_tokens, rows, ends = fast.expert_order(ids, NUM_EXPERTS)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    assert torch.equal(sorted_tokens, order // TOP_K)
    assert torch.equal(rows[order], torch.arange(flat.numel()))
    assert ends.dtype == torch.int32
    assert torch.equal(ends.long(), torch.bincount(flat, minlength=NUM_EXPERTS).cumsum(0))
