"""Attention input preparation: the ops of ref.py, run by triton.py on CUDA (kernels/backend.py)."""

from ninfer.kernels.attention_prep import ref
from ninfer.kernels.backend import dispatched

prepare_qkv = dispatched(__name__, ref.prepare_qkv)
