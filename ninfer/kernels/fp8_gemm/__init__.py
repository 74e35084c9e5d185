"""Block-scaled FP8 GEMM for prefill (per-token 128-column activation groups times block-scaled
e4m3 weights): the ops of ref.py, run by triton.py on CUDA (kernels/backend.py)."""

from ninfer.kernels.backend import dispatched
from ninfer.kernels.fp8_gemm import ref

quantize_groups = dispatched(__name__, ref.quantize_groups)
block_fp8_matmul = dispatched(__name__, ref.block_fp8_matmul)
fp8_linear = dispatched(__name__, ref.fp8_linear)

__all__ = ["block_fp8_matmul", "fp8_linear", "quantize_groups"]
