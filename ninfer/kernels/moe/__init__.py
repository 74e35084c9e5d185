"""Mixture-of-experts routing and experts: the ops of ref.py, run by triton.py on CUDA (kernels/backend.py)."""

from ninfer.kernels.backend import dispatched
from ninfer.kernels.moe import ref

route = dispatched(__name__, ref.route)
fused_experts = dispatched(__name__, ref.fused_experts)
dequantize_experts = dispatched(__name__, ref.dequantize_experts)
