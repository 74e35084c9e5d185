"""float16 Linear weights for a float32 model on the CPU (ninfer/models/quant/half_weights.py).

The same checkpoint loaded in fp32 is the reference: prefill (weights widened to fp32) and
decode (float16 GEMV, activations rounded to float16) must stay within a few float16 steps
of its logits, on a plain Llama (tied embedding), a Qwen3 MoE (the router stays fp32) and a
Qwen3.5 hybrid (in_proj's conv decode step runs on the product).
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import transformers as tf
from torch import nn

from ninfer.models.layers.linear import Linear
from ninfer.models.quant.half_weights import HalfWeightLinear, store_half_weights_
from tests.models.helpers import load_ours, normal_init, randomize_, run_chunked, run_full, save_hf, uniform_init

VOCAB = 512
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
QWEN3_5 = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
MODELS = {
    "llama_tied": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, tie_word_embeddings=True)),
    "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(
        tf.Qwen3MoeConfig(**SMALL, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    ),
    "qwen3_5": lambda: tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**QWEN3_5)),
}
GDN_INIT = {"A_log": uniform_init(0.01, 2.0, torch.log), "linear_attn.norm.weight": normal_init(1.0, 0.3)}
# Logit error against the fp32 model, relative to the logits' largest magnitude.
REL_ATOL = 5e-3


def _models(kind: str) -> tuple[nn.Module, nn.Module]:
    """(fp32 model, the same model with float16 Linear weights)."""
    torch.manual_seed(0)
    hf = randomize_(MODELS[kind]().eval(), seed=1, overrides=GDN_INIT)
    with tempfile.TemporaryDirectory() as directory:
        config, tensors = save_hf(hf, directory)
    reference = load_ours(config, tensors)
    half = copy.deepcopy(reference)
    store_half_weights_(half)
    return reference, half


@pytest.mark.parametrize("kind", list(MODELS))
def test_prefill_and_decode_stay_close_to_fp32(kind: str) -> None:
    reference, half = _models(kind)
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(2))
    expected = run_full(reference, ids)
    scale = expected.abs().max().item()
    assert scale > 1.0
    # A 6-token prefill chunk (widened weights), then decode steps (the float16 GEMV).
    got = run_chunked(half, ids, [6, 1])
    torch.testing.assert_close(got, expected, atol=REL_ATOL * scale, rtol=0)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_which_layers_are_replaced() -> None:
    reference, half = _models("qwen3_moe")
    modules = dict(half.named_modules())
    linears = [name for name, m in reference.named_modules() if isinstance(m, nn.Linear)]
    routers = [name for name in linears if name.endswith("mlp.gate")]
    assert routers and all(type(modules[name]) is Linear for name in routers)
    assert all(isinstance(modules[name], HalfWeightLinear) for name in linears if name not in routers)
    assert all(modules[name].weight.dtype == torch.float16 for name in linears if name not in routers)
    assert half.model.embed_tokens.weight.dtype == torch.float32
    qkv = modules["model.layers.0.self_attn.qkv_proj"]
    assert qkv.parts == reference.get_submodule("model.layers.0.self_attn.qkv_proj").parts


def test_tied_lm_head_gets_its_own_copy() -> None:
    reference, half = _models("llama_tied")
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    assert isinstance(half.lm_head, HalfWeightLinear)
    torch.testing.assert_close(half.lm_head.weight, half.model.embed_tokens.weight.half(), atol=0, rtol=0)


def test_weights_beyond_float16_range_stay_fp32() -> None:
    layer = nn.Linear(4, 3)
    with torch.no_grad():
        layer.weight[1, 2] = 1e5
    model = nn.Sequential(layer, nn.Linear(3, 2))
    assert store_half_weights_(model) == 1
    assert type(model[0]) is nn.Linear and isinstance(model[1], HalfWeightLinear)
