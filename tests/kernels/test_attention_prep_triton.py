"""Our fused attention prep kernel (q/k RMSNorm + rotary + K/V cache write) under Triton's CPU interpreter.

Tolerances. fp32: the same operations in another order (sum of squares in three pieces),
1e-5. bf16: the kernel computes in fp32 and rounds once, while the reference rounds to bf16
after the norm and after each rotary multiply and add; so it is checked (a) to one bf16
rounding (the two bf16 values are equal or neighbours) against the reference run in fp32 on
the same upcast inputs, and (b) to 2 ulps of the largest value against the bf16 reference.
v is a copy and pass-through dims without a norm are copies: those must match exactly.
(Triton's interpreter casts fp32 -> bf16 by truncation where the GPU rounds to nearest
even: still within one bf16 rounding.)

The compiled kernel at the real shapes is tested in tests/gpu/test_attention_prep.py.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.attention_prep import ref
from tests.kernels.interpreter import cpu_interpreter, interpreted  # noqa: F401 (autouse fixture)

fast = interpreted("ninfer.kernels.attention_prep.triton")

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 32
NUM_PAGES, PAGE_SIZE = 5, 4
EPS = 1e-6
FP32 = {"atol": 1e-5, "rtol": 1e-5}
ONE_BF16_ROUNDING = {"atol": 1e-5, "rtol": 2**-7}  # results O(1): one ulp is <= 2^-7 relative


def _assert_near_bf16_reference(out: torch.Tensor, expected: torch.Tensor) -> None:
    """The reference's extra bf16 roundings (after the norm, each rotary multiply, the add)
    move it at most ~2 ulps of its largest operands away: bound by 2 ulps of its largest value."""
    out, expected = out.float(), expected.float()
    assert (out - expected).abs().max() <= 2**-6 * expected.abs().max()


def _inputs(
    num_tokens: int,
    rotary_dim: int,
    dtype: torch.dtype,
    norm: str,
    layout: str,
    seed: int,
    cache_dtype: torch.dtype | None = None,
):
    """q, k, v as views of one packed projection output, as the attention layer makes them.

    layout "gated": q_proj rows interleave [query_h | gate_h] per head, q = view(T, Hq, 2D)[..., :D];
    "plain": q, k, v are column slices; "head_major": k, v come from [Hk, T, D] buffers (head
    stride < token stride is not required by the kernel).
    """
    gen = torch.Generator().manual_seed(seed)
    q_cols = NUM_Q_HEADS * HEAD_DIM * (2 if layout == "gated" else 1)
    kv_cols = NUM_KV_HEADS * HEAD_DIM
    packed = (torch.randn(num_tokens, q_cols + 2 * kv_cols + 3, generator=gen) * 2).to(dtype)
    if layout == "gated":
        q = packed[:, :q_cols].view(num_tokens, NUM_Q_HEADS, 2 * HEAD_DIM)[..., :HEAD_DIM]
    else:
        q = packed[:, :q_cols].view(num_tokens, NUM_Q_HEADS, HEAD_DIM)
    k = packed[:, q_cols : q_cols + kv_cols].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    v = packed[:, q_cols + kv_cols : q_cols + 2 * kv_cols].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    if layout == "head_major":
        k = (torch.randn(NUM_KV_HEADS, num_tokens, HEAD_DIM, generator=gen) * 2).to(dtype).transpose(0, 1)
        v = (torch.randn(NUM_KV_HEADS, num_tokens, HEAD_DIM, generator=gen) * 2).to(dtype).transpose(0, 1)

    q_weight = k_weight = None
    if norm != "none":
        center = 0.0 if norm == "zero_centered" else 1.0
        q_weight = (center + 0.3 * torch.randn(HEAD_DIM, generator=gen)).to(dtype)
        k_weight = (center + 0.3 * torch.randn(HEAD_DIM, generator=gen)).to(dtype)
    # Independent angles per dim (not the usual duplicated halves): the kernel may not assume cos1 == cos2.
    angles = torch.rand(num_tokens, rotary_dim, generator=gen) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    cache_dtype = cache_dtype or dtype
    shape = (NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    # Unordered slots across pages, some pages untouched.
    slots = torch.randperm(NUM_PAGES * PAGE_SIZE, generator=gen)[:num_tokens]
    return q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, slots


def _run(impl, inputs, zero_centered: bool, upcast: bool = False):
    """(q_out, k_cache, v_cache) of impl on copies of the caches; upcast runs everything in fp32."""
    q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, slots = inputs
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    if upcast:
        q, k, v, cos, sin, k_cache, v_cache = (x.float() for x in (q, k, v, cos, sin, k_cache, v_cache))
        q_weight = None if q_weight is None else q_weight.float()
        k_weight = None if k_weight is None else k_weight.float()
    q_out = impl(q, k, v, q_weight, k_weight, EPS, zero_centered, cos, sin, k_cache, v_cache, slots)
    return q_out, k_cache, v_cache


def _check(inputs, zero_centered: bool, dtype: torch.dtype) -> None:
    q, _, v, *_, k_cache_before, v_cache_before, slots = inputs
    q_out, k_cache, v_cache = _run(fast.prepare_qkv, inputs, zero_centered)
    q_ref, k_cache_ref, v_cache_ref = _run(ref.prepare_qkv, inputs, zero_centered)
    assert q_out.shape == q.shape and q_out.dtype == q.dtype and q_out.is_contiguous()
    assert k_cache.dtype == k_cache_before.dtype
    # v is copied and every slot not written keeps its bytes.
    assert torch.equal(v_cache, v_cache_ref)
    written = torch.zeros(NUM_PAGES * PAGE_SIZE, dtype=torch.bool)
    written[slots] = True
    untouched = ~written.view(NUM_PAGES, PAGE_SIZE)
    assert torch.equal(k_cache[untouched], k_cache_before[untouched])
    assert torch.equal(v_cache[untouched], v_cache_before[untouched])
    if dtype == torch.float32:
        torch.testing.assert_close(q_out, q_ref, **FP32)
        torch.testing.assert_close(k_cache, k_cache_ref, **FP32)
        return
    q_32, k_cache_32, _ = _run(ref.prepare_qkv, inputs, zero_centered, upcast=True)
    torch.testing.assert_close(q_out, q_32.to(dtype), **ONE_BF16_ROUNDING)
    torch.testing.assert_close(k_cache, k_cache_32.to(k_cache.dtype), **ONE_BF16_ROUNDING)
    _assert_near_bf16_reference(q_out, q_ref)
    _assert_near_bf16_reference(k_cache, k_cache_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [16, HEAD_DIM])
@pytest.mark.parametrize("norm", ["none", "plain", "zero_centered"])
def test_gated_layout_matches_reference(dtype: torch.dtype, rotary_dim: int, norm: str) -> None:
    inputs = _inputs(5, rotary_dim, dtype, norm, layout="gated", seed=rotary_dim)
    _check(inputs, norm == "zero_centered", dtype)


@pytest.mark.parametrize("layout", ["plain", "head_major"])
def test_other_layouts(layout: str) -> None:
    inputs = _inputs(4, 16, torch.bfloat16, "zero_centered", layout=layout, seed=7)
    _check(inputs, True, torch.bfloat16)


def test_pass_through_dims_are_copied_without_a_norm() -> None:
    inputs = _inputs(3, 16, torch.bfloat16, "none", layout="gated", seed=3)
    q, k, *_, slots = inputs
    q_out, k_cache, _ = _run(fast.prepare_qkv, inputs, False)
    assert torch.equal(q_out[..., 16:], q[..., 16:])
    flat = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(flat[slots][..., 16:], k[..., 16:])


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_cache_dtype_differs_from_k(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    # k is rounded to its own dtype, then cast to the cache's, as k.to(cache dtype) in the reference.
    inputs = _inputs(4, 16, dtype, "plain", layout="gated", seed=11, cache_dtype=cache_dtype)
    q, k, v, *_, slots = inputs
    if cache_dtype == torch.bfloat16:
        # The interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest even):
        # bf16-exact v values make its copy exact under both.
        v.copy_(v.to(torch.bfloat16))
    q_out, k_cache, v_cache = _run(fast.prepare_qkv, inputs, False)
    q_ref, k_cache_ref, v_cache_ref = _run(ref.prepare_qkv, inputs, False)
    assert torch.equal(v_cache, v_cache_ref)
    k_written = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots]
    k_written_ref = k_cache_ref.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots]
    if dtype == torch.float32:
        torch.testing.assert_close(q_out, q_ref, **FP32)
        # fp32 results a few ulp apart (or truncated, in the interpreter) round to neighbouring bf16 values.
        torch.testing.assert_close(k_written, k_written_ref, **ONE_BF16_ROUNDING)
    else:
        _, k_cache_32, _ = _run(ref.prepare_qkv, inputs, False, upcast=True)
        k_written_32 = k_cache_32.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots]
        # The fp32 cache holds bf16 values of k exactly.
        assert torch.equal(k_written, k_written.to(dtype).float())
        torch.testing.assert_close(k_written, k_written_32.to(dtype).float(), **ONE_BF16_ROUNDING)
        _assert_near_bf16_reference(k_written, k_written_ref)


def test_no_tokens() -> None:
    q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, slots = _inputs(0, 16, torch.float32, "plain", "gated", 0)
    before = k_cache.clone()
    q_out = fast.prepare_qkv(q, k, v, q_weight, k_weight, EPS, False, cos, sin, k_cache, v_cache, slots)
    assert q_out.shape == (0, NUM_Q_HEADS, HEAD_DIM)
    assert torch.equal(k_cache, before)
