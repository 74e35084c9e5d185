"""Comparing low-precision kernel outputs with their references in units of the last place."""

from __future__ import annotations

import torch

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


def assert_matches(out: torch.Tensor, expected: torch.Tensor, max_mismatch: float = 0.01, max_ulps: int = 1) -> None:
    """fp32: summation order only. bf16/fp16: at most `max_ulps` apart, and nearly all bitwise
    equal: a missing or extra rounding changes 20-30 % of the elements (tried)."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert out.is_contiguous()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        return
    a, b = out.float(), expected.float()
    exponent = torch.frexp(torch.maximum(a.abs(), b.abs()))[1]  # |v| in [2^(e-1), 2^e)
    ulp = torch.ldexp(torch.ones_like(a), exponent - 1 - MANTISSA_BITS[out.dtype])
    assert ((a - b).abs() <= max_ulps * ulp).all(), f"max difference {(a - b).abs().max().item()}"
    mismatched = (a != b).float().mean().item()
    assert mismatched <= max_mismatch, f"{mismatched:.2%} of elements differ"
