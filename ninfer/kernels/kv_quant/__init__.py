"""Quantized KV rows (int8, fp8, nvfp4): layout, quantization and dequantization; see ref.py."""

from ninfer.kernels.kv_quant.ref import (
    FP8,
    INT8,
    NVFP4,
    STORAGE_DTYPES,
    check_head_dim,
    dequantize_rows,
    format_of,
    head_dim_of,
    quantize_rows,
    row_bytes,
)

__all__ = [
    "FP8",
    "INT8",
    "NVFP4",
    "STORAGE_DTYPES",
    "check_head_dim",
    "dequantize_rows",
    "format_of",
    "head_dim_of",
    "quantize_rows",
    "row_bytes",
]
