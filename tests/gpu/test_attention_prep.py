"""Fused attention prep (q/k RMSNorm + rotary + K/V cache write) on the GPU vs ref.py; CUDA-graph replay.

The kernel computes in fp32 and rounds once; the bf16 reference rounds after the norm and
after each rotary op. So q and the cached k are checked to one bf16 rounding (equal or
neighbouring bf16 values) against the reference run in fp32 on the same upcast inputs, and
to 2 ulps of the largest value against the bf16 reference. v, and every cache slot not
written, must match exactly.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.attention_prep import prepare_qkv, ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# name: (Hq, Hk, head_dim, rotary_dim, norm, gated q layout)
SHAPES = {
    "Qwen3.5-27B": (24, 4, 256, 64, "zero_centered", True),
    "Qwen3.5-35B-A3B": (16, 2, 256, 64, "zero_centered", True),
    "Qwen3-8B": (32, 8, 128, 128, "plain", False),
    "Llama-8B": (32, 8, 128, 128, "none", False),
}
PAGE_SIZE = 16
EPS = 1e-6
ONE_BF16_ROUNDING = {"atol": 1e-5, "rtol": 2**-7}


def _packed(num_tokens: int, shape: str, seed: int) -> torch.Tensor:
    """One bf16 projection output [T, q cols | k cols | v cols]."""
    num_q_heads, num_kv_heads, head_dim, _, _, gated = SHAPES[shape]
    cols = num_q_heads * head_dim * (2 if gated else 1) + 2 * num_kv_heads * head_dim
    gen = torch.Generator("cuda").manual_seed(seed)
    return (torch.randn(num_tokens, cols, device="cuda", generator=gen) * 2).bfloat16()


def _views(packed: torch.Tensor, shape: str):
    num_q_heads, num_kv_heads, head_dim, _, _, gated = SHAPES[shape]
    num_tokens = packed.shape[0]
    q_cols = num_q_heads * head_dim * (2 if gated else 1)
    kv_cols = num_kv_heads * head_dim
    if gated:  # q_proj rows interleave [query_h | gate_h]
        q = packed[:, :q_cols].view(num_tokens, num_q_heads, 2 * head_dim)[..., :head_dim]
    else:
        q = packed[:, :q_cols].view(num_tokens, num_q_heads, head_dim)
    k = packed[:, q_cols : q_cols + kv_cols].view(num_tokens, num_kv_heads, head_dim)
    v = packed[:, q_cols + kv_cols :].view(num_tokens, num_kv_heads, head_dim)
    return q, k, v


def _rope(num_tokens: int, rotary_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 cos/sin of random positions, built like RotaryEmbedding (duplicated halves)."""
    gen = torch.Generator("cuda").manual_seed(seed)
    positions = torch.randint(0, 131072, (num_tokens,), device="cuda", generator=gen).float()
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rotary_dim, 2, device="cuda").float() / rotary_dim))
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().bfloat16(), emb.sin().bfloat16()


def _weights(shape: str):
    _, _, head_dim, _, norm, _ = SHAPES[shape]
    if norm == "none":
        return None, None
    gen = torch.Generator("cuda").manual_seed(head_dim)
    center = 0.0 if norm == "zero_centered" else 1.0
    q_weight = (center + 0.3 * torch.randn(head_dim, device="cuda", generator=gen)).bfloat16()
    k_weight = (center + 0.3 * torch.randn(head_dim, device="cuda", generator=gen)).bfloat16()
    return q_weight, k_weight


def _caches(num_pages: int, shape: str, seed: int):
    _, num_kv_heads, head_dim, _, _, _ = SHAPES[shape]
    gen = torch.Generator("cuda").manual_seed(seed)
    size = (num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    return (
        torch.randn(size, device="cuda", generator=gen).bfloat16(),
        torch.randn(size, device="cuda", generator=gen).bfloat16(),
    )


def _assert_near_bf16_reference(out: torch.Tensor, expected: torch.Tensor) -> None:
    out, expected = out.float(), expected.float()
    assert (out - expected).abs().max() <= 2**-6 * expected.abs().max()


def _call(impl, q, k, v, weights, shape, cos, sin, k_cache, v_cache, slots):
    return impl(q, k, v, *weights, EPS, SHAPES[shape][4] == "zero_centered", cos, sin, k_cache, v_cache, slots)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 8, 1000])
def test_matches_reference(shape: str, num_tokens: int) -> None:
    rotary_dim = SHAPES[shape][3]
    q, k, v = _views(_packed(num_tokens, shape, seed=num_tokens), shape)
    cos, sin = _rope(num_tokens, rotary_dim, seed=num_tokens)
    weights = _weights(shape)
    num_pages = num_tokens // PAGE_SIZE + 3
    k_cache, v_cache = _caches(num_pages, shape, seed=1)
    gen = torch.Generator("cuda").manual_seed(2)
    slots = torch.randperm(num_pages * PAGE_SIZE, device="cuda", generator=gen)[:num_tokens]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_32, v_32 = k_cache.float(), v_cache.float()
    k_before, v_before = k_cache.clone(), v_cache.clone()

    q_out = _call(prepare_qkv, q, k, v, weights, shape, cos, sin, k_cache, v_cache, slots)
    q_ref = _call(ref.prepare_qkv, q, k, v, weights, shape, cos, sin, k_ref, v_ref, slots)
    weights_32 = tuple(None if w is None else w.float() for w in weights)
    q_32 = _call(
        ref.prepare_qkv, q.float(), k.float(), v.float(), weights_32, shape, cos.float(), sin.float(), k_32, v_32, slots
    )

    assert q_out.shape == q.shape and q_out.dtype == torch.bfloat16 and q_out.is_contiguous()
    torch.testing.assert_close(q_out, q_32.bfloat16(), **ONE_BF16_ROUNDING)
    torch.testing.assert_close(k_cache, k_32.bfloat16(), **ONE_BF16_ROUNDING)
    _assert_near_bf16_reference(q_out, q_ref)
    _assert_near_bf16_reference(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
    untouched = torch.ones(num_pages * PAGE_SIZE, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    untouched = untouched.view(num_pages, PAGE_SIZE)
    assert torch.equal(k_cache[untouched], k_before[untouched])
    assert torch.equal(v_cache[untouched], v_before[untouched])


@pytest.mark.parametrize("shape", ["Qwen3.5-27B", "Llama-8B"])
def test_replays_in_a_cuda_graph(shape: str) -> None:
    num_tokens, num_pages = 8, 6
    rotary_dim = SHAPES[shape][3]
    packed = _packed(num_tokens, shape, seed=0)
    q, k, v = _views(packed, shape)
    cos, sin = _rope(num_tokens, rotary_dim, seed=0)
    weights = _weights(shape)
    k_cache, v_cache = _caches(num_pages, shape, seed=0)
    slots = torch.arange(num_tokens, device="cuda")
    start_k, start_v = k_cache.clone(), v_cache.clone()
    _call(prepare_qkv, q, k, v, weights, shape, cos, sin, k_cache, v_cache, slots)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_q = _call(prepare_qkv, q, k, v, weights, shape, cos, sin, k_cache, v_cache, slots)

    steps = []
    for seed in (1, 2, 3):
        gen = torch.Generator("cuda").manual_seed(seed)
        new_slots = torch.randperm(num_pages * PAGE_SIZE, device="cuda", generator=gen)[:num_tokens]
        steps.append((_packed(num_tokens, shape, seed=seed), *_rope(num_tokens, rotary_dim, seed=seed), new_slots))
    k_cache.copy_(start_k)
    v_cache.copy_(start_v)
    eager = []
    for new_packed, new_cos, new_sin, new_slots in steps:
        new_q, new_k, new_v = _views(new_packed, shape)
        q_e = _call(prepare_qkv, new_q, new_k, new_v, weights, shape, new_cos, new_sin, k_cache, v_cache, new_slots)
        eager.append((q_e, k_cache.clone(), v_cache.clone()))
    k_cache.copy_(start_k)
    v_cache.copy_(start_v)
    for (new_packed, new_cos, new_sin, new_slots), (q_e, k_e, v_e) in zip(steps, eager):
        packed.copy_(new_packed)
        cos.copy_(new_cos)
        sin.copy_(new_sin)
        slots.copy_(new_slots)
        graph.replay()
        assert torch.equal(static_q, q_e)
        assert torch.equal(k_cache, k_e)
        assert torch.equal(v_cache, v_e)
