"""The routed MoE block at decode sizes (router choice, experts, shared expert) in three launches:
the op of ref.py, run by triton.py on CUDA (kernels/backend.py)."""

import torch

from ninfer.kernels.backend import dispatched
from ninfer.kernels.moe_block import ref
from ninfer.kernels.moe_block.ref import MAX_TOKENS


def _decode_sized(x: torch.Tensor) -> bool:
    return x.shape[0] <= MAX_TOKENS


moe_block = dispatched(__name__, ref.moe_block, fast_when=_decode_sized)
