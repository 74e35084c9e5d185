"""x @ W^T for NVFP4 weights at prefill sizes (any M): see ref.py; the GEMM in triton.py."""

from ninfer.kernels.backend import dispatched
from ninfer.kernels.nvfp4_gemm import ref

nvfp4_matmul = dispatched(__name__, ref.nvfp4_matmul)

__all__ = ["nvfp4_matmul"]
