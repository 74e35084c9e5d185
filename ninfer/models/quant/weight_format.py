"""weight_format: the storage format holding most of a model's matrix weights (server_start).

Quantized checkpoints keep a few layers (embeddings, heads, gates) in the compute dtype, so the
format is the one of the most weight elements across Linear layers and expert groups: nvfp4,
fp8, or the dtype of plain weights (float16 for CPU half-weight storage, bfloat16, float32).
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from ninfer.models.layers.moe import Experts
from ninfer.models.quant.fp8 import Fp8Linear
from ninfer.models.quant.fp8_experts import Fp8Experts
from ninfer.models.quant.half_weights import HalfWeightLinear
from ninfer.models.quant.nvfp4 import Nvfp4Linear
from ninfer.models.quant.nvfp4_experts import Nvfp4Experts


def weight_format(model: nn.Module) -> str:
    elements: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, Nvfp4Linear):
            elements["nvfp4"] += 2 * module.weight.numel()  # two codes a byte
        elif isinstance(module, Nvfp4Experts):
            elements["nvfp4"] += module.num_weights
        elif isinstance(module, (Fp8Linear, Fp8Experts)):
            elements["fp8"] += sum(t.numel() for t in module.buffers(recurse=False) if t.element_size() == 1)
        elif isinstance(module, (nn.Linear, HalfWeightLinear)):
            elements[str(module.weight.dtype).removeprefix("torch.")] += module.weight.numel()
        elif isinstance(module, Experts):
            for tensor in module.parameters(recurse=False):
                elements[str(tensor.dtype).removeprefix("torch.")] += tensor.numel()
    return elements.most_common(1)[0][0] if elements else "none"
