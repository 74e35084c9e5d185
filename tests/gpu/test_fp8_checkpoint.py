"""A block-scaled FP8 checkpoint loaded natively on the GPU: packed projections become
row-block-scaled Fp8Linear layers whose GEMV (decode rows) and block-scaled FP8 GEMM (prefill
rows, kernels/fp8_gemm) equal the same layers loaded dequantized on the CPU."""

from __future__ import annotations

import pytest
import torch

from ninfer.models.config import ModelConfig
from ninfer.models.loader import load_model
from ninfer.models.quant.fp8 import Fp8Linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HF_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 384,
    "intermediate_size": 1000, "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 2,
    "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
SHAPES = {
    "model.embed_tokens.weight": (512, 384), "lm_head.weight": (512, 384), "model.norm.weight": (384,),
    "model.layers.0.input_layernorm.weight": (384,), "model.layers.0.post_attention_layernorm.weight": (384,),
    "model.layers.0.self_attn.q_proj.weight": (384, 384), "model.layers.0.self_attn.k_proj.weight": (128, 384),
    "model.layers.0.self_attn.v_proj.weight": (128, 384), "model.layers.0.self_attn.o_proj.weight": (384, 384),
    "model.layers.0.mlp.gate_proj.weight": (1000, 384), "model.layers.0.mlp.up_proj.weight": (1000, 384),
    "model.layers.0.mlp.down_proj.weight": (384, 1000),
}
FP8_NAMES = [n for n in SHAPES if n.endswith("proj.weight") and "v_proj" not in n]  # v_proj stays bf16


def _checkpoint() -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) in load order: each FP8 weight right after its 128x128 block scales."""
    gen = torch.Generator().manual_seed(0)
    items = []
    for name, shape in SHAPES.items():
        value = torch.randn(shape, generator=gen) * (shape[-1] ** -0.5 if len(shape) == 2 else 0.1)
        if name not in FP8_NAMES:
            items.append((name, value.bfloat16()))
            continue
        rows, cols = shape
        scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=gen) * 1e-3 + 1e-3
        expanded = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        items.append((name + "_scale_inv", scale))
        items.append((name, (value / expanded).clamp(-448, 448).to(torch.float8_e4m3fn)))
    return items


def test_native_fp8_layers_equal_the_dequantized_cpu_layers() -> None:
    config = ModelConfig.from_hf(HF_CONFIG)
    fp8_weights = {name: SHAPES[name] for name in FP8_NAMES}
    gpu = load_model(config, iter(_checkpoint()), dtype=torch.bfloat16, device="cuda", progress=False,
                     fp8_weights=fp8_weights)
    cpu = load_model(config, iter(_checkpoint()), dtype=torch.float32, device="cpu", progress=False,
                     fp8_weights=fp8_weights)
    layer_gpu, layer_cpu = gpu.model.layers[0], cpu.model.layers[0]
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        module_gpu, module_cpu = layer_gpu.get_submodule(name), layer_cpu.get_submodule(name)
        assert isinstance(module_gpu, Fp8Linear) and module_gpu.weight_scale.shape[0] == module_gpu.weight.shape[0]
        assert torch.equal(module_gpu.weight.cpu().view(torch.uint8), module_cpu.weight.view(torch.uint8))
        for num_rows in (1, 8, 40):  # GEMV (FMA, tensor cores) and the FP8 GEMM
            x = torch.randn(num_rows, module_cpu.in_features, generator=torch.Generator().manual_seed(num_rows))
            expected = x @ module_cpu.dequantized(torch.float32).T
            out = module_gpu(x.cuda().bfloat16()).float().cpu()
            error = (out - expected).abs().max().item()
            # The GEMM also quantizes x per 128-column group to e4m3 (2^-4 of each value).
            tolerance = 2**-7 if num_rows <= 16 else 2**-3
            assert error <= tolerance * expected.abs().max().item() + 1e-3, (name, num_rows, error)
