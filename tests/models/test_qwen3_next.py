"""Qwen3-Next: parity with transformers from a hub-layout checkpoint, and chunked vs full forward.

The hub layout fuses the GDN projections per key head (in_proj_qkvz, in_proj_ba) and stores
experts one by one; transformers 5.17's save_pretrained writes exactly that (asserted below).
Tolerance: fp32 logits within atol 1e-4 (observed ~1e-5).
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import transformers as tf

from ninfer.models.config import ModelConfig
from tests.models.helpers import load_ours, normal_init, randomize_, run_chunked, run_full, save_hf, uniform_init

VOCAB = 1024
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=32,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=6,  # 3 v-heads per key head: the interleave is not a plain split
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=48,
    shared_expert_intermediate_size=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
VARIANTS = {
    # a dense MLP layer among MoE layers, un-normalised top-k weights
    "mlp_only_layer": dict(mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=False),
    # MoE every second layer, renormalised top-k weights
    "sparse_step_2": dict(mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=True),
}
GDN_INIT = {"A_log": uniform_init(0.01, 2.0, torch.log), "linear_attn.norm.weight": normal_init(1.0, 0.3)}
FP32_ATOL = 1e-4
SEQ_LEN = 70


class Checkpoint:
    def __init__(self, variant: str, seed: int):
        torch.manual_seed(seed)
        config = tf.Qwen3NextConfig(**BASE, **VARIANTS[variant])
        self.hf = randomize_(tf.Qwen3NextForCausalLM(config).eval(), seed, overrides=GDN_INIT)
        with tempfile.TemporaryDirectory() as directory:
            self.config, self.tensors = save_hf(self.hf, directory)


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, Checkpoint]:
    return {variant: Checkpoint(variant, 10 + i) for i, variant in enumerate(VARIANTS)}


def _tokens(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def test_checkpoint_is_in_the_hub_layout(checkpoints: dict[str, Checkpoint]) -> None:
    names = checkpoints["mlp_only_layer"].tensors.keys()
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names
    assert "model.layers.0.linear_attn.in_proj_ba.weight" in names
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names
    assert not any(n.endswith("in_proj_qkv.weight") or n.endswith("experts.gate_up_proj") for n in names)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(checkpoints: dict[str, Checkpoint], variant: str) -> None:
    ckpt = checkpoints[variant]
    config = ModelConfig.from_hf(ckpt.config)
    assert config.family == "qwen3_next" and config.mrope_section is None
    ours = load_ours(ckpt.config, ckpt.tensors)
    moe_layers = [i for i, layer in enumerate(ours.model.layers) if hasattr(layer.mlp, "experts")]
    assert moe_layers == ([0, 2, 3] if variant == "mlp_only_layer" else [1, 3])
    assert all(ours.model.layers[i].mlp.renormalize == config.norm_topk_prob for i in moe_layers)

    input_ids = _tokens(SEQ_LEN, seed=1)
    with torch.no_grad():
        expected = ckpt.hf(input_ids=input_ids[None]).logits[0]
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(run_full(ours, input_ids), expected, atol=FP32_ATOL, rtol=0)


def test_deinterleaved_projections_equal_transformers_split(checkpoints: dict[str, Checkpoint]) -> None:
    """Our packed in_proj parts qkv/z/b/a reproduce transformers' fix_query_key_value_ordering on real inputs."""
    ckpt = checkpoints["sparse_step_2"]
    ours = load_ours(ckpt.config, ckpt.tensors)
    hf_gdn = ckpt.hf.model.layers[0].linear_attn
    gdn = ours.model.layers[0].linear_attn
    x = torch.randn(1, 5, BASE["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q, k, v, z, b, a = hf_gdn.fix_query_key_value_ordering(hf_gdn.in_proj_qkvz(x), hf_gdn.in_proj_ba(x))
        qkv = torch.cat([t.reshape(1, 5, -1) for t in (q, k, v)], dim=-1)
        ours_qkv, ours_z, ours_b, ours_a = gdn.in_proj(x).split(gdn.in_proj_sizes, dim=-1)
        torch.testing.assert_close(ours_qkv, qkv)
        torch.testing.assert_close(ours_z, z.reshape(1, 5, -1))
        torch.testing.assert_close(ours_b, b)
        torch.testing.assert_close(ours_a, a)


@pytest.mark.parametrize("chunk_sizes", [[1], [5], [16], [64, 2, 1]], ids=lambda c: "-".join(map(str, c)))
def test_chunked_prefill_and_decode_equal_full_forward(
    checkpoints: dict[str, Checkpoint], chunk_sizes: list[int]
) -> None:
    ckpt = checkpoints["mlp_only_layer"]
    ours = load_ours(ckpt.config, ckpt.tensors)
    input_ids = _tokens(SEQ_LEN, seed=2)
    chunked = run_chunked(ours, input_ids, chunk_sizes)
    torch.testing.assert_close(chunked, run_full(ours, input_ids), atol=FP32_ATOL, rtol=0)
