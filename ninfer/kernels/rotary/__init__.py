"""Rotary embedding: the op of ref.py (on CUDA, attention_prep fuses it with the norms and the KV write)."""

from ninfer.kernels.backend import dispatched
from ninfer.kernels.rotary import ref

apply_rotary = dispatched(__name__, ref.apply_rotary)
