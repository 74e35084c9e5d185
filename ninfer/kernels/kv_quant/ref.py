"""Quantized KV rows: the byte layout of one (token, KV head) row of keys or values.

A quantized cache keeps the plain cache's shape [..., page_size, Hk, W] with a row of W
bytes per token and head, codes then scales, so every page-level operation (copying pages,
the host tier, StateImage-adjacent bookkeeping, byte accounting) moves scales with codes
and needs no change. The cache tensor's dtype names its format:

    format  dtype          row (head_dim D)                                  bytes (D=256)
    int8    int8           D codes (round(x / s), |code| <= 127) | s (fp32)  260
    fp8     float8_e4m3fn  D codes (x / s as e4m3)               | s (fp32)  260
    nvfp4   uint8          D/2 e2m1 codes (two a byte, low nibble first)
                           | D/16 e4m3 block scales | s (fp32)               148

s is the row's scale: amax / 127 (int8), amax / 448 (fp8), amax / (6 * 448) (nvfp4, whose
block scales are in units of s), each computed as amax times the fp32 reciprocal: torch on
CUDA divides by a Python scalar that way and on the CPU exactly, so the product is what gives
the same bits on both (and in the Triton kernels). Scales are stored as raw little-endian fp32
bytes. Plain caches (bf16, fp16, fp32) hold values as they are.
"""

from __future__ import annotations

import torch

from ninfer.kernels.nvfp4_gemv.ref import BLOCK, E2M1_MAX, E4M3_MAX, dequantize_nvfp4, quantize_nvfp4

INT8 = "int8"
FP8 = "fp8"
NVFP4 = "nvfp4"
STORAGE_DTYPES = {INT8: torch.int8, FP8: torch.float8_e4m3fn, NVFP4: torch.uint8}
FORMATS = {dtype: name for name, dtype in STORAGE_DTYPES.items()}
SCALE_BYTES = 4
INT8_MAX = 127.0
# The scales' factors (fp32 in torch and in Triton alike): amax times these.
INV_INT8_MAX = 1.0 / INT8_MAX
INV_FP8_MAX = 1.0 / E4M3_MAX
INV_NVFP4_MAX = 1.0 / (E2M1_MAX * E4M3_MAX)
_TINY = torch.finfo(torch.float32).tiny


def format_of(cache: torch.Tensor) -> str | None:
    """The quantized format a cache tensor holds, or None for plain values."""
    return FORMATS.get(cache.dtype)


def row_bytes(fmt: str, head_dim: int) -> int:
    """Bytes of one row of head_dim values in `fmt`."""
    if fmt == NVFP4:
        return head_dim // 2 + head_dim // BLOCK + SCALE_BYTES
    return head_dim + SCALE_BYTES


def check_head_dim(fmt: str, head_dim: int) -> str | None:
    """Why `fmt` cannot hold rows of head_dim values, or None: the fp32 scale must sit 4-byte aligned."""
    if fmt == NVFP4 and head_dim % 64:
        return f"nvfp4 KV needs a head_dim that is a multiple of 64, not {head_dim}"
    if head_dim % 4:
        return f"{fmt} KV needs a head_dim that is a multiple of 4, not {head_dim}"
    return None


def head_dim_of(cache: torch.Tensor) -> int:
    """The head_dim a quantized cache's rows hold."""
    width = cache.shape[-1] - SCALE_BYTES
    return width if format_of(cache) != NVFP4 else width * 16 // 9


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    return scale.float().contiguous().unsqueeze(-1).view(torch.uint8)


def quantize_rows(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [..., D] -> [..., row_bytes(fmt, D)] of the format's storage dtype."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1]).float()
    amax = rows.abs().amax(dim=-1)
    if fmt == NVFP4:
        scale = (amax * INV_NVFP4_MAX).clamp(min=_TINY)
        codes, block_scale, scale = quantize_nvfp4(rows, scale)
        parts = [codes, block_scale.view(torch.uint8), _scale_bytes(scale)]
    elif fmt == INT8:
        scale = (amax * INV_INT8_MAX).clamp(min=_TINY)
        codes = torch.round(rows / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        parts = [codes.view(torch.uint8), _scale_bytes(scale)]
    elif fmt == FP8:
        scale = (amax * INV_FP8_MAX).clamp(min=_TINY)
        codes = (rows / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        parts = [codes.view(torch.uint8), _scale_bytes(scale)]
    else:
        raise ValueError(f"unknown KV format {fmt!r}")
    packed = torch.cat(parts, dim=-1).view(STORAGE_DTYPES[fmt])
    return packed.reshape(*shape[:-1], packed.shape[-1])


def dequantize_rows(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[..., W] rows of a quantized cache (format from their dtype) -> float32 [..., head_dim]."""
    fmt = format_of(rows)
    shape = rows.shape
    raw = rows.reshape(-1, shape[-1]).view(torch.uint8)
    scale = raw[:, -SCALE_BYTES:].contiguous().view(torch.float32).reshape(-1)
    if fmt == NVFP4:
        codes = raw[:, : head_dim // 2]
        block_scale = raw[:, head_dim // 2 : head_dim // 2 + head_dim // BLOCK].contiguous().view(torch.float8_e4m3fn)
        values = dequantize_nvfp4(codes, block_scale, scale)
    elif fmt == INT8:
        values = raw[:, :head_dim].view(torch.int8).float() * scale[:, None]
    elif fmt == FP8:
        values = raw[:, :head_dim].contiguous().view(torch.float8_e4m3fn).float() * scale[:, None]
    else:
        raise ValueError(f"a {rows.dtype} cache holds plain values, not a quantized format")
    return values.reshape(*shape[:-1], head_dim)
