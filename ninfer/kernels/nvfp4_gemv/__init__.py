"""x @ W^T for NVFP4 weights (e2m1 codes, e4m3 scales per 16 values, fp32 row scales): see ref.py."""

from ninfer.kernels.backend import dispatched
from ninfer.kernels.nvfp4_gemv import ref
from ninfer.kernels.nvfp4_gemv.ref import BLOCK, dequantize_nvfp4, quantize_nvfp4

gemv_nvfp4 = dispatched(__name__, ref.gemv_nvfp4)

__all__ = ["BLOCK", "dequantize_nvfp4", "gemv_nvfp4", "quantize_nvfp4"]
