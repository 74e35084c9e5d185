"""The routed MoE block at decode sizes (router choice, experts, shared expert) in three launches:
the op of ref.py, run by triton.py on CUDA (kernels/backend.py). The layers choose it up to
MAX_TOKENS tokens (models/layers/moe.py); the kernels themselves take any count."""

from ninfer.kernels.backend import dispatched
from ninfer.kernels.moe_block import ref
from ninfer.kernels.moe_block.ref import MAX_TOKENS

__all__ = ["MAX_TOKENS", "moe_block"]

moe_block = dispatched(__name__, ref.moe_block)
