"""FP8 activation quantization: the ops of ref.py, run by triton.py on CUDA (kernels/backend.py)."""

from ninfer.kernels.backend import dispatched
from ninfer.kernels.fp8_quant import ref

quantize_rows = dispatched(__name__, ref.quantize_rows)
