"""--quantize at load: the model is built with its quantized modules unfilled and each bf16 weight
is quantized into them as it arrives. Every parameter and buffer equals, bit for bit, the same
checkpoint loaded unquantized then quantized by quantize_fp8_ / quantize_nvfp4_ (Qwen3.5 dense
and MoE, fused and per-expert experts, Llama-family, checkpoints already partly quantized), and
no quantized layer's unquantized weights are ever all held: the load's measured allocation
peak is the quantized model plus the row-chunk workspace."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ninfer.bench.random_weights import stored_parameters
from ninfer.bench.shapes import shape_config
from ninfer.engine.builder import model_bytes
from ninfer.models.config import ModelConfig
from ninfer.models.loader import QUANTIZE_AT_LOAD, build_model, load_model
from ninfer.models.quant import row_chunks
from ninfer.models.quant.row_chunks import workspace_bytes
from ninfer.models.quant.stored_formats import stored_tensors
from ninfer.testing.tiny_artifacts import MOE, TEXT
from tests.models.allocation_peak import allocation_peak

LOAD_CHUNK = row_chunks.CHUNK_ELEMENTS  # a real load's chunk
CHUNK = 1000  # weights per chunk in these tests: every projection of their models spans several chunks

# The tiny Qwen3.5 trunk with its MTP head, and a small vocabulary (no tokenizer is needed).
QWEN3_5 = {
    **TEXT, "model_type": "qwen3_5_text", "vocab_size": 96, "mtp_num_hidden_layers": 1, "torch_dtype": "bfloat16",
}
QWEN3_5_MOE = {**QWEN3_5, **MOE, "model_type": "qwen3_5_moe_text"}
LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "attention_bias": True, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QWEN3_MOE = {
    **LLAMA, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
    "num_hidden_layers": 3, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "mlp_only_layers": [1], "norm_topk_prob": False,
}
# Where checkpoints store routed experts one tensor per expert: Qwen3.5 in its MTP layer (the trunk's
# are fused), Qwen3-MoE everywhere.
PER_EXPERT = {"qwen3_5_moe_text": "mtp.", "qwen3_moe": ""}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(row_chunks, "CHUNK_ELEMENTS", CHUNK)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def assert_same_model(ours: nn.Module, theirs: nn.Module) -> None:
    """Same module tree (types), and every parameter and buffer with the same dtype, shape and bits."""
    assert {n: type(m) for n, m in ours.named_modules()} == {n: type(m) for n, m in theirs.named_modules()}
    for named in (nn.Module.named_parameters, nn.Module.named_buffers):
        a, b = dict(named(ours, remove_duplicate=False)), dict(named(theirs, remove_duplicate=False))
        assert a.keys() == b.keys()
        for name in a:
            assert (a[name].dtype, a[name].shape) == (b[name].dtype, b[name].shape), name
            assert torch.equal(_bits(a[name]), _bits(b[name])), name


def _checkpoint(config: ModelConfig, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Random fp32 tensors under the checkpoint's names, routed experts one tensor per expert
    where PER_EXPERT says (gate and up rows as slices of the fused weight)."""
    gen = torch.Generator().manual_seed(seed)
    per_expert = PER_EXPERT.get(config.model_type)
    tensors = []
    for name, meta in stored_parameters(build_model(config, torch.float32, "meta")):
        value = torch.randn(meta.shape, generator=gen) * (meta.shape[-1] ** -0.5 if meta.dim() >= 2 else 0.3)
        prefix, _, projection = name.rpartition(".")
        if not (prefix.endswith(".experts") and per_expert is not None and name.startswith(per_expert)):
            tensors.append((name, value))
            continue
        inter = config.moe_intermediate_size
        for expert in range(value.shape[0]):
            if projection == "down_proj":
                tensors.append((f"{prefix}.{expert}.down_proj.weight", value[expert]))
            else:
                tensors.append((f"{prefix}.{expert}.gate_proj.weight", value[expert, :inter]))
                tensors.append((f"{prefix}.{expert}.up_proj.weight", value[expert, inter:]))
    return tensors


def _stored_as(weights: str, tensors: list[tuple[str, torch.Tensor]]) -> tuple[list, dict[str, tuple[int, ...]]]:
    """The checkpoint in a quantized checkpoint layout (stored_formats.py), as an artifact yields it
    (each weight right after its scales) -> (tensors, the quantized weights' unpacked shapes)."""
    items, shapes = [], {}
    for name, tensor in tensors:
        stored = stored_tensors(weights, name, tensor.bfloat16())
        if len(stored) == 1:
            items.append((name, tensor))
            continue
        shapes[name] = tuple(tensor.shape)
        items += [(n, t) for n, t in stored.items() if n != name and not n.endswith("input_scale")]
        items.append((name, stored[name]))
    return items, shapes


def _load_both(config: ModelConfig, tensors: list, quantize: str, **stored) -> tuple[nn.Module, nn.Module]:
    """(quantized as it loads, loaded then quantized)."""
    expected = load_model(config, iter(tensors), dtype=torch.bfloat16, progress=False, **stored)
    assert QUANTIZE_AT_LOAD[quantize](expected) > 0
    ours = load_model(config, iter(tensors), dtype=torch.bfloat16, progress=False, quantize=quantize, **stored)
    return ours, expected


@pytest.mark.parametrize("quantize", ["fp8", "nvfp4"])
@pytest.mark.parametrize("hf_config", [QWEN3_5, QWEN3_5_MOE, LLAMA, QWEN3_MOE], ids=lambda c: c["model_type"])
def test_quantized_as_it_loads_equals_quantized_after(hf_config: dict, quantize: str) -> None:
    """fp32 tensors into a bf16 model: each is rounded to bf16 before it is quantized, as loading it did."""
    config = ModelConfig.from_hf(hf_config)
    assert_same_model(*_load_both(config, _checkpoint(config, seed=len(hf_config)), quantize))


@pytest.mark.parametrize("stored, quantize", [("fp8", "nvfp4"), ("fp8", "fp8"), ("nvfp4", "fp8")])
def test_a_quantized_checkpoint_keeps_its_format_and_the_rest_is_quantized_as_it_loads(
    stored: str, quantize: str
) -> None:
    """Qwen's FP8 and ModelOpt's NVFP4 layouts (every 2-D projection, the MTP layer's experts too)
    stay as stored; the trunk's fused experts and the remaining Linear layers are quantized."""
    config = ModelConfig.from_hf(QWEN3_5_MOE)
    tensors, shapes = _stored_as(stored, _checkpoint(config, seed=3))
    assert_same_model(*_load_both(config, tensors, quantize, **{f"{stored}_weights": shapes}))


@pytest.mark.parametrize("quantize", ["fp8", "nvfp4"])
def test_the_load_peak_is_the_quantized_model_and_one_chunks_workspace(quantize: str) -> None:
    """Measured on the CPU allocator with the checkpoint already in memory: everything a load
    allocates beyond the model is the workspace of one chunk (and a few small tensors). Loading
    unquantized then quantizing holds every quantized layer's bf16 weights beside the model."""
    config = ModelConfig.from_hf({**LLAMA, "hidden_size": 128, "intermediate_size": 384, "attention_bias": False})
    tensors = _checkpoint(config, seed=5)
    ours, peak = allocation_peak(
        lambda: load_model(config, iter(tensors), dtype=torch.bfloat16, progress=False, quantize=quantize)
    )
    bound = model_bytes(ours) + workspace_bytes(largest_row=config.intermediate_size) + (64 << 10)
    assert peak <= bound

    def load_then_quantize() -> nn.Module:
        model = load_model(config, iter(tensors), dtype=torch.bfloat16, progress=False)
        QUANTIZE_AT_LOAD[quantize](model)
        return model

    expected, peak_after = allocation_peak(load_then_quantize)
    assert_same_model(ours, expected)
    quantized_bf16 = sum(
        m.weight.numel() * 2 for n, m in load_model(config, iter(tensors), dtype=torch.bfloat16, progress=False)
        .named_modules() if isinstance(m, nn.Linear) and n != "lm_head"
    )  # fmt: skip
    assert peak_after >= model_bytes(ours) + quantized_bf16 > bound


@pytest.mark.parametrize("quantize", ["fp8", "nvfp4"])
@pytest.mark.parametrize("shape", ["27b", "35b-a3b"])
def test_the_real_models_quantized_at_load_fit_an_80_gb_card(shape: str, quantize: str) -> None:
    """The bound at the real shapes, built on the meta device: the quantized model plus one chunk's
    workspace (384 MiB) is less than the bf16 model alone and fits the ~78 GiB of an 80 GB H100
    (27B: 27.4 GiB in FP8, 17.5 GiB in NVFP4; 35B-A3B: 33.4 and 19.7)."""
    _, config = shape_config(shape)
    bf16 = model_bytes(build_model(config, torch.bfloat16, "meta"))
    quantized = model_bytes(build_model(config, torch.bfloat16, "meta", quantize=quantize))
    bound = quantized + workspace_bytes(chunk_elements=LOAD_CHUNK)
    assert bound < min(bf16, 78 << 30)
