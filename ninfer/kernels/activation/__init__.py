"""Activations: the ops of ref.py, run by triton.py on CUDA (kernels/backend.py)."""

from ninfer.kernels.activation import ref
from ninfer.kernels.backend import dispatched

silu_and_mul = dispatched(__name__, ref.silu_and_mul)
sigmoid_mul = dispatched(__name__, ref.sigmoid_mul)
