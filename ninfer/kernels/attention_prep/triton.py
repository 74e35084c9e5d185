"""Attention input prep in one Triton launch: q/k RMSNorm, rotary, K/V cache write.

Replaces, per attention layer, two norms (~6 torch kernels each in bf16), the rotary
(~8 kernels for q and k) and the two index_copy_ of store_kv. One program per (token,
head) over the Hq query heads and then the Hk key heads; a key-head program also copies
the matching v head into the v cache.

A head row is loaded as three contiguous pieces, the two rotary halves x1, x2 and the
pass-through tail, so the rotate-half partner of every element is already in registers
and every byte is loaded once (no partner gather). The norm and rotation run in fp32 and
round once: the reference rounds to q's dtype after the norm and after each rotary op, so
in bf16 the two differ by about one rounding (see the tests). k is rounded to k's dtype
before the cast to the cache dtype, as the reference stores k.to(cache dtype).

Quantized caches (kernels/kv_quant): an int8 or fp8 K/V row is quantized in registers as it
is written (row amax, scale, codes, then the codes and the fp32 scale as bytes), with the
reference's operations (scales as products with fp32 reciprocals, IEEE divisions for the
codes, round half to even), so its bytes are what quantize_rows makes of the same row.
nvfp4 rows need each 16-value block's amax and adjacent pairs of codes in one byte, which
the three pieces do not line up with: the fused launch writes k (in k's dtype) to a scratch
row instead, and _store_nvfp4_rows_kernel quantizes whole rows of it (and of v) into the
cache in a second launch.

Capture-safe: the grid and every constexpr come from shapes; slot_mapping is read on device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.attention_prep import ref
from ninfer.kernels.backend import fast_version
from ninfer.kernels.kv_quant import ref as kv_quant
from ninfer.kernels.paged_attention.triton import cache_format
from ninfer.kernels.pdl import pdl_enabled, pdl_sync

# kv_quant.ref's constants, as constexprs the kernels can read.
INT8_MAX = tl.constexpr(kv_quant.INT8_MAX)
E4M3_MAX = tl.constexpr(kv_quant.E4M3_MAX)
INV_INT8_MAX = tl.constexpr(kv_quant.INV_INT8_MAX)
INV_FP8_MAX = tl.constexpr(kv_quant.INV_FP8_MAX)
INV_NVFP4_MAX = tl.constexpr(kv_quant.INV_NVFP4_MAX)
# quantize_nvfp4 divides a block's amax by a Python scalar 6, which torch on CUDA computes as
# this product and on the CPU exactly; the e4m3 rounding that follows hides the difference
# unless the quotient sits within an fp32 ulp of an e4m3 rounding boundary.
INV_E2M1_MAX = tl.constexpr(1.0 / kv_quant.E2M1_MAX)
FP32_TINY = tl.constexpr(torch.finfo(torch.float32).tiny)  # a row scale's floor


@triton.jit
def _norm_weight(w_ptr, offsets, mask, ZERO_CENTERED: tl.constexpr):
    w = tl.load(w_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = 1.0 + w  # Qwen3.5 stores w around 0 and scales by (1 + w)
    return w


@triton.jit
def _norm_rotate_row(
    row_ptr,
    w_ptr,
    cos1,
    sin1,
    cos2,
    sin2,
    o_half,
    o_pass,
    eps,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
):
    """One head row -> (rotated first half, rotated second half, pass-through tail), fp32."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    m_half = o_half < HALF
    m_pass = o_pass < HEAD_DIM - ROTARY_DIM
    x1 = tl.load(row_ptr + o_half, mask=m_half, other=0.0).to(tl.float32)
    x2 = tl.load(row_ptr + HALF + o_half, mask=m_half, other=0.0).to(tl.float32)
    x3 = tl.load(row_ptr + ROTARY_DIM + o_pass, mask=m_pass, other=0.0).to(tl.float32)
    if HAS_NORM:
        sum_sq = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0) + tl.sum(x3 * x3, axis=0)
        rstd = tl.rsqrt(sum_sq / HEAD_DIM + eps)
        # (x * rstd) * w, the reference's association.
        x1 = x1 * rstd * _norm_weight(w_ptr, o_half, m_half, ZERO_CENTERED)
        x2 = x2 * rstd * _norm_weight(w_ptr, HALF + o_half, m_half, ZERO_CENTERED)
        x3 = x3 * rstd * _norm_weight(w_ptr, ROTARY_DIM + o_pass, m_pass, ZERO_CENTERED)
    # neox rotate-half: [x1, x2] * cos + [-x2, x1] * sin.
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2, x3


@triton.jit
def _round_half_even(x):
    """x (|x| < 2^22) to an integer, ties to even, as torch.round: after adding 1.5 * 2^23 no
    fraction bits are left, and IEEE addition rounds to nearest even (libdevice's rint does not
    run in the interpreter)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _row_scale(amax, INV_CODE_MAX: tl.constexpr):
    return tl.maximum(amax * INV_CODE_MAX, FP32_TINY)


@triton.jit
def _codes(x, scale, FMT: tl.constexpr):
    """quantize_rows' int8 or fp8 codes of x / scale (an IEEE division: Triton's `/` is approximate)."""
    scaled = tl.math.div_rn(x, scale)
    if FMT == "int8":
        codes = tl.minimum(tl.maximum(_round_half_even(scaled), -INT8_MAX), INT8_MAX).to(tl.int8)
    else:
        codes = tl.minimum(tl.maximum(scaled, -E4M3_MAX), E4M3_MAX).to(tl.float8e4nv)
    return codes


@triton.jit
def _store_quantized_row(
    row_ptr, x1, x2, x3, o_half, o_pass, m_half, m_pass, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
    FMT: tl.constexpr,
):
    """One int8 or fp8 cache row from its three fp32 pieces (zero where masked): codes, then the
    row scale as fp32 bytes."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(x1), 0), tl.max(tl.abs(x2), 0)), tl.max(tl.abs(x3), 0))
    if FMT == "int8":
        scale = _row_scale(amax, INV_INT8_MAX)
    else:
        scale = _row_scale(amax, INV_FP8_MAX)
    tl.store(row_ptr + o_half, _codes(x1, scale, FMT), mask=m_half)
    tl.store(row_ptr + HALF + o_half, _codes(x2, scale, FMT), mask=m_half)
    tl.store(row_ptr + ROTARY_DIM + o_pass, _codes(x3, scale, FMT), mask=m_pass)
    tl.store((row_ptr + HEAD_DIM).to(tl.pointer_type(tl.float32)), scale)


@triton.jit
def _prepare_qkv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    q_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos_t,
    stride_sin_t,
    stride_kc_page,
    stride_kc_offset,
    stride_kc_head,
    stride_vc_page,
    stride_vc_offset,
    stride_vc_head,
    page_size,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    USE_PDL: tl.constexpr,
    K_FMT: tl.constexpr,
    V_FMT: tl.constexpr,
):
    """K_FMT, V_FMT: "plain", "int8", "fp8" or "nvfp4". nvfp4: k_cache_ptr is a [T, Hk, D]
    scratch in k's dtype (its strides in stride_kc_offset, stride_kc_head) and v is left alone,
    for _store_nvfp4_rows_kernel."""
    pdl_sync(USE_PDL)  # before the first global load or store
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HALF: tl.constexpr = ROTARY_DIM // 2
    o_half = tl.arange(0, BLOCK_HALF)
    o_pass = tl.arange(0, BLOCK_PASS)
    m_half = o_half < HALF
    m_pass = o_pass < HEAD_DIM - ROTARY_DIM  # all false without a pass-through tail
    p_cos = cos_ptr + t * stride_cos_t + o_half
    p_sin = sin_ptr + t * stride_sin_t + o_half
    cos1 = tl.load(p_cos, mask=m_half, other=0.0).to(tl.float32)
    cos2 = tl.load(p_cos + HALF, mask=m_half, other=0.0).to(tl.float32)
    sin1 = tl.load(p_sin, mask=m_half, other=0.0).to(tl.float32)
    sin2 = tl.load(p_sin + HALF, mask=m_half, other=0.0).to(tl.float32)

    if h < NUM_Q_HEADS:
        y1, y2, y3 = _norm_rotate_row(
            q_ptr + t * stride_qt + h * stride_qh,
            q_weight_ptr,
            cos1,
            sin1,
            cos2,
            sin2,
            o_half,
            o_pass,
            eps,
            HEAD_DIM,
            ROTARY_DIM,
            HAS_NORM,
            ZERO_CENTERED,
        )
        p_out = q_out_ptr + (t * NUM_Q_HEADS + h) * HEAD_DIM
        out_dtype = q_out_ptr.dtype.element_ty
        tl.store(p_out + o_half, y1.to(out_dtype), mask=m_half)
        tl.store(p_out + HALF + o_half, y2.to(out_dtype), mask=m_half)
        tl.store(p_out + ROTARY_DIM + o_pass, y3.to(out_dtype), mask=m_pass)
    else:
        h_kv = h - NUM_Q_HEADS
        slot = tl.load(slots_ptr + t).to(tl.int64)
        page = slot // page_size
        offset = slot - page * page_size
        y1, y2, y3 = _norm_rotate_row(
            k_ptr + t * stride_kt + h_kv * stride_kh,
            k_weight_ptr,
            cos1,
            sin1,
            cos2,
            sin2,
            o_half,
            o_pass,
            eps,
            HEAD_DIM,
            ROTARY_DIM,
            HAS_NORM,
            ZERO_CENTERED,
        )
        if K_FMT == "nvfp4":
            p_k = k_cache_ptr + t * stride_kc_offset + h_kv * stride_kc_head  # the scratch row
        else:
            p_k = k_cache_ptr + page * stride_kc_page + offset * stride_kc_offset + h_kv * stride_kc_head
        k_dtype = k_ptr.dtype.element_ty
        if K_FMT == "plain" or K_FMT == "nvfp4":
            k_cache_dtype = k_cache_ptr.dtype.element_ty
            tl.store(p_k + o_half, y1.to(k_dtype).to(k_cache_dtype), mask=m_half)
            tl.store(p_k + HALF + o_half, y2.to(k_dtype).to(k_cache_dtype), mask=m_half)
            tl.store(p_k + ROTARY_DIM + o_pass, y3.to(k_dtype).to(k_cache_dtype), mask=m_pass)
        else:
            # Quantized from k rounded to its dtype, as the reference quantizes k.
            k1 = y1.to(k_dtype).to(tl.float32)
            k2 = y2.to(k_dtype).to(tl.float32)
            k3 = y3.to(k_dtype).to(tl.float32)
            _store_quantized_row(p_k, k1, k2, k3, o_half, o_pass, m_half, m_pass, HEAD_DIM, ROTARY_DIM, K_FMT)

        # v is only copied (cast to the cache dtype); the same three pieces cover the row.
        p_v = v_ptr + t * stride_vt + h_kv * stride_vh
        p_vc = v_cache_ptr + page * stride_vc_page + offset * stride_vc_offset + h_kv * stride_vc_head
        if V_FMT == "plain":
            v_cache_dtype = v_cache_ptr.dtype.element_ty
            v1 = tl.load(p_v + o_half, mask=m_half)
            v2 = tl.load(p_v + HALF + o_half, mask=m_half)
            tl.store(p_vc + o_half, v1.to(v_cache_dtype), mask=m_half)
            tl.store(p_vc + HALF + o_half, v2.to(v_cache_dtype), mask=m_half)
            v_pass = tl.load(p_v + ROTARY_DIM + o_pass, mask=m_pass)
            tl.store(p_vc + ROTARY_DIM + o_pass, v_pass.to(v_cache_dtype), mask=m_pass)
        elif V_FMT != "nvfp4":
            v1 = tl.load(p_v + o_half, mask=m_half, other=0.0).to(tl.float32)
            v2 = tl.load(p_v + HALF + o_half, mask=m_half, other=0.0).to(tl.float32)
            v3 = tl.load(p_v + ROTARY_DIM + o_pass, mask=m_pass, other=0.0).to(tl.float32)
            _store_quantized_row(p_vc, v1, v2, v3, o_half, o_pass, m_half, m_pass, HEAD_DIM, ROTARY_DIM, V_FMT)


@triton.jit
def _e2m1_codes(x, scale):
    """quantize_nvfp4's e2m1 code (0..15) of x / scale, 0 where scale is 0: the nearest magnitude,
    a tie going to the even code. Counting the midpoints below |x| decides the same (|x| - m is
    exact next to each midpoint); a midpoint whose upper neighbour is the even code counts when reached."""
    scaled = tl.where(scale > 0, tl.math.div_rn(x, tl.maximum(scale, 1e-30)), 0.0)
    a = tl.abs(scaled)
    magnitude = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    magnitude += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return tl.where((scaled < 0) & (magnitude > 0), magnitude + 8, magnitude)


@triton.jit
def _store_nvfp4_rows_kernel(
    src_ptr,
    cache_ptr,
    slots_ptr,
    stride_st,
    stride_sh,
    stride_c_page,
    stride_c_offset,
    stride_c_head,
    page_size,
    HEAD_DIM: tl.constexpr,
    BLOCKS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per (token, head): src row [HEAD_DIM] -> its nvfp4 cache row, as quantize_rows.
    Held as [blocks of 16, 8] tiles of the even and of the odd elements, so a block's amax is a
    row reduction and each code byte's two elements sit in one lane."""
    pdl_sync(USE_PDL)  # the scratch rows are the previous launch's
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    page = slot // page_size
    offset = slot - page * page_size
    blk = tl.arange(0, BLOCKS)
    pair = tl.arange(0, 8)
    valid = (blk < HEAD_DIM // 16)[:, None] & (pair < 8)[None, :]
    p_src = src_ptr + t * stride_st + h * stride_sh + blk[:, None] * 16 + 2 * pair[None, :]
    even = tl.load(p_src, mask=valid, other=0.0).to(tl.float32)
    odd = tl.load(p_src + 1, mask=valid, other=0.0).to(tl.float32)
    block_amax = tl.maximum(tl.max(tl.abs(even), 1), tl.max(tl.abs(odd), 1))
    row_scale = _row_scale(tl.max(block_amax, 0), INV_NVFP4_MAX)
    block_scale = tl.minimum(tl.math.div_rn(block_amax * INV_E2M1_MAX, row_scale), E4M3_MAX)
    block_scale = block_scale.to(tl.float8e4nv)
    scale = (block_scale.to(tl.float32) * row_scale)[:, None]
    packed = _e2m1_codes(even, scale) | (_e2m1_codes(odd, scale) << 4)

    p_row = cache_ptr + page * stride_c_page + offset * stride_c_offset + h * stride_c_head
    tl.store(p_row + blk[:, None] * 8 + pair[None, :], packed.to(tl.uint8), mask=valid)
    tl.store(p_row + HEAD_DIM // 2 + blk, block_scale.to(tl.uint8, bitcast=True), mask=blk < HEAD_DIM // 16)
    tl.store((p_row + HEAD_DIM // 2 + HEAD_DIM // 16).to(tl.pointer_type(tl.float32)), row_scale)


def _check(q, k, v, q_norm_weight, k_norm_weight, cos, sin, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, _, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together")
    named = {"q": q, "k": k, "v": v, "cos": cos, "sin": sin, "k_cache": k_cache, "v_cache": v_cache}
    for name, t in named.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")
    # A quantized cache's rows have their own width (cache_format checks it).
    plain_widths = [cache.shape[-1] for cache in (k_cache, v_cache) if kv_quant.format_of(cache) is None]
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[2] != k.shape[1] or set(plain_widths) - {head_dim}:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not hold k {tuple(k.shape)}")
    rotary_dim = cos.shape[-1]
    if cos.shape != (num_tokens, rotary_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be [T, rotary_dim]")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and in [2, {head_dim}]")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q and k norms come together or not at all")
    for w in (q_norm_weight, k_norm_weight):
        if w is not None and (w.shape != (head_dim,) or w.stride(0) != 1):
            raise ValueError(f"norm weights must be contiguous [{head_dim}], got {tuple(w.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be [{num_tokens}]")


@fast_version(ref.prepare_qkv)
def prepare_qkv(q, k, v, q_norm_weight, k_norm_weight, eps, zero_centered, cos, sin, k_cache, v_cache, slot_mapping):
    """One launch (plus one per nvfp4 cache); capture-safe.

    q, k, v may have any token and head strides (column slices of a packed projection, the
    gated layout's interleaved query halves); last dims must be contiguous.
    """
    _check(q, k, v, q_norm_weight, k_norm_weight, cos, sin, k_cache, v_cache, slot_mapping)
    k_fmt, v_fmt = cache_format(k_cache, q.shape[-1]), cache_format(v_cache, q.shape[-1])
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = cos.shape[-1]
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    has_norm = q_norm_weight is not None
    pass_dim = head_dim - rotary_dim
    # Qwen3.5's row (64 rotary + 192 tail, bf16) is 8 elements a thread on one warp.
    num_warps = max(1, min(4, triton.next_power_of_2(head_dim) // 256))
    use_pdl = pdl_enabled(q)
    # nvfp4 keys go through a scratch row in k's dtype (see the module docstring).
    k_dest = torch.empty_like(k, memory_format=torch.contiguous_format) if k_fmt == kv_quant.NVFP4 else k_cache
    k_dest_strides = (0, *k_dest.stride()[:2]) if k_fmt == kv_quant.NVFP4 else k_cache.stride()[:3]
    _prepare_qkv_kernel[(num_tokens, num_q_heads + num_kv_heads)](
        q,
        k,
        v,
        q_norm_weight if has_norm else q,  # unread placeholders without a norm
        k_norm_weight if has_norm else k,
        cos,
        sin,
        k_dest,
        v_cache,
        slot_mapping,
        q_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        *k_dest_strides,
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_cache.shape[1],
        eps,
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        ROTARY_DIM=rotary_dim,
        BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
        BLOCK_PASS=triton.next_power_of_2(max(pass_dim, 1)),
        HAS_NORM=has_norm,
        ZERO_CENTERED=bool(zero_centered),
        USE_PDL=use_pdl,
        K_FMT=k_fmt,
        V_FMT=v_fmt,
        num_warps=num_warps,
        launch_pdl=use_pdl,
    )
    for rows, cache, fmt in ((k_dest, k_cache, k_fmt), (v, v_cache, v_fmt)):
        if fmt == kv_quant.NVFP4:
            _store_nvfp4_rows_kernel[(num_tokens, num_kv_heads)](
                rows,
                cache,
                slot_mapping,
                rows.stride(0),
                rows.stride(1),
                cache.stride(0),
                cache.stride(1),
                cache.stride(2),
                cache.shape[1],
                HEAD_DIM=head_dim,
                BLOCKS=triton.next_power_of_2(head_dim // kv_quant.BLOCK),
                USE_PDL=use_pdl,
                num_warps=1,
                launch_pdl=use_pdl,
            )
    return q_out
