"""The tensor-parallel shard plan: each rank's parameters, loaded from the checkpoint through the
plan, are exactly its part of the whole model's, and the parts put back together are the whole
model (every family, 2 and 4 ranks; KV heads shared by ranks when there are fewer than ranks).
Quantized checkpoints (Qwen's block FP8 with FP8 experts, ModelOpt's NVFP4) kept in their format:
each rank's quantized layers dequantize to its part of the whole model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer.artifact import open_artifact
from ninfer.artifact.packer import pack
from ninfer.kernels.moe.ref import dequantize_experts
from ninfer.models.config import ModelConfig
from ninfer.models.quant.fp8 import Fp8Linear
from ninfer.models.quant.fp8_experts import PROJECTIONS, Fp8Experts
from ninfer.models.quant.nvfp4 import Nvfp4Linear
from ninfer.models.quant.nvfp4_experts import Nvfp4Experts
from ninfer.parallel.shard_plan import LeaderOnly, ShardPlan, Split, local_config, tensor_parallel_problem
from ninfer.testing.tiny_quantized import modelopt_nvfp4_copy, qwen_fp8_copy
from tests.engine.test_tensor_parallel import ARCHITECTURES, write_artifact
from tests.models.fp8_experts_checkpoint import fp8_moe_checkpoint


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("shard-plan")
    return {arch: write_artifact(arch, root / arch) for arch in ARCHITECTURES}


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_each_rank_loads_its_part_and_the_parts_make_the_whole(artifacts, arch, size):
    artifact = open_artifact(artifacts[arch])
    whole = dict(artifact.load_model(dtype=torch.float32, progress=False).named_parameters())
    plans = [ShardPlan(artifact.config, rank, size) for rank in range(size)]
    ranks = [dict(artifact.load_model(dtype=torch.float32, progress=False, shard=plan).named_parameters())
             for plan in plans]  # fmt: skip
    assert all(rank.keys() == whole.keys() for rank in ranks)
    for name, full in whole.items():
        for plan, rank in zip(plans, ranks):
            assert torch.equal(rank[name], plan.shard(name, full)), f"{name} on rank {plan.rank}"
        assert torch.equal(ShardPlan.unshard(plans, name, [rank[name] for rank in ranks]), full), name


QUANTIZED_LAYERS = (Fp8Linear, Nvfp4Linear, Fp8Experts, Nvfp4Experts)


def dense_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter in fp32, quantized layers' weights dequantized, by the unquantized model's names."""
    dense = {name: p.detach().float() for name, p in model.named_parameters()}
    for module_name, module in model.named_modules():
        if isinstance(module, (Fp8Linear, Nvfp4Linear)):
            dense[f"{module_name}.weight"] = module.dequantized(torch.float32)
        elif isinstance(module, (Fp8Experts, Nvfp4Experts)):
            for projection in PROJECTIONS:
                weight, scale = getattr(module, projection), module.scale_of(projection)
                dense[f"{module_name}.{projection}"] = dequantize_experts(weight, scale, torch.float32)
    return dense


def quantized_layouts(model) -> dict[str, str]:
    return {name: type(module).__name__ for name, module in model.named_modules() if isinstance(module, QUANTIZED_LAYERS)}


@pytest.fixture(scope="module")
def quantized_checkpoints(artifacts, tmp_path_factory) -> dict[str, str]:
    """FP8 and NVFP4 copies of the families' checkpoints, and FP8 MoE checkpoints with FP8 fused
    experts whose intermediate size is inside one 128-row block (32), a rank's share of it
    aligned with the blocks (256 over 2 ranks) and not (128 over 2 ranks)."""
    root = tmp_path_factory.mktemp("quantized")
    copies = {f"{arch}-fp8": qwen_fp8_copy(Path(artifacts[arch]), root / f"{arch}-fp8") for arch in ("qwen3_next", "llama")}
    copies.update({f"{arch}-nvfp4": modelopt_nvfp4_copy(Path(artifacts[arch]), root / f"{arch}-nvfp4")
                   for arch in ("qwen3_5", "qwen3_5_moe")})  # fmt: skip
    copies.update({f"moe-fp8-i{inter}": fp8_moe_checkpoint(root, inter) for inter in (32, 128, 256)})
    return {name: str(path) for name, path in copies.items()}


@pytest.mark.parametrize(
    "checkpoint, size",
    [("qwen3_next-fp8", 2), ("qwen3_next-fp8", 4), ("llama-fp8", 2), ("qwen3_5-nvfp4", 4), ("qwen3_5_moe-nvfp4", 2),
     ("moe-fp8-i32", 2), ("moe-fp8-i128", 2), ("moe-fp8-i256", 2)],
)  # fmt: skip
def test_quantized_weights_split_as_stored(quantized_checkpoints, checkpoint, size):
    artifact = open_artifact(quantized_checkpoints[checkpoint])
    keep = {"keep_fp8": True} if "fp8" in checkpoint else {"keep_nvfp4": True}
    whole_model = artifact.load_model(dtype=torch.float32, progress=False, **keep)
    whole = dense_weights(whole_model)
    layouts = quantized_layouts(whole_model)
    assert layouts
    for rank in range(size):
        plan = ShardPlan(artifact.config, rank, size)
        model = artifact.load_model(dtype=torch.float32, progress=False, shard=plan, **keep)
        assert quantized_layouts(model) == layouts  # every layer kept in its stored format
        dense = dense_weights(model)
        assert dense.keys() == whole.keys()
        for name, full in whole.items():
            assert torch.equal(dense[name], plan.shard(name, full)), f"{name} on rank {rank}"


@pytest.fixture(scope="module")
def containers(artifacts, quantized_checkpoints, tmp_path_factory) -> dict[str, str]:
    """`ninfer pack` containers: bf16 (llama, with row-parallel biases), per-channel FP8 with per-row
    FP8 experts (qwen3_next), NVFP4 layers and experts (qwen3_5_moe), and an FP8 checkpoint's
    block FP8 kept as stored with 128-row expert blocks that a rank's 64 rows do not start."""
    root = tmp_path_factory.mktemp("containers")
    sources = {"llama-bf16": (artifacts["llama"], "bf16"), "qwen3_next-fp8": (artifacts["qwen3_next"], "fp8"),
               "qwen3_5_moe-nvfp4": (artifacts["qwen3_5_moe"], "nvfp4"),
               "moe-fp8-i128": (quantized_checkpoints["moe-fp8-i128"], "fp8")}  # fmt: skip
    made = {}
    for name, (source, weights) in sources.items():
        made[name] = str(root / f"{name}.ninfer")
        pack(source, made[name], weights=weights, progress=False)
    return made


@pytest.mark.parametrize(
    "container, size", [("llama-bf16", 2), ("qwen3_next-fp8", 4), ("qwen3_5_moe-nvfp4", 2), ("moe-fp8-i128", 2)]
)
def test_a_container_splits_as_saved(containers, container, size):
    artifact = open_artifact(containers[container])
    whole_model = artifact.load_model(dtype=torch.float32, progress=False)
    whole = dense_weights(whole_model)
    layouts = quantized_layouts(whole_model)
    assert bool(layouts) == ("bf16" not in container)
    for rank in range(size):
        plan = ShardPlan(artifact.config, rank, size)
        model = artifact.load_model(dtype=torch.float32, progress=False, shard=plan)
        assert quantized_layouts(model) == layouts
        dense = dense_weights(model)
        assert dense.keys() == whole.keys()
        for name, full in whole.items():
            assert torch.equal(dense[name], plan.shard(name, full)), f"{name} on rank {rank}"


def test_a_ranks_share_of_fp8_experts_takes_the_block_layout_its_rows_allow(quantized_checkpoints):
    """Gate and up of 256 rows over 2 ranks: 128 each, still in 128-row blocks; 128 over 2: 64
    each, which start inside a block, so the rank keeps a scale row per weight row."""
    for inter, rows_per_block in ((256, 128), (128, 1)):
        artifact = open_artifact(quantized_checkpoints[f"moe-fp8-i{inter}"])
        whole = artifact.load_model(dtype=torch.float32, progress=False, keep_fp8=True)
        rank = artifact.load_model(dtype=torch.float32, progress=False, keep_fp8=True, shard=ShardPlan(artifact.config, 1, 2))
        experts = "model.layers.0.mlp.experts"
        assert whole.get_submodule(experts).rows_per_block("gate_up_proj") == 128
        assert rank.get_submodule(experts).rows_per_block("gate_up_proj") == rows_per_block


def test_the_split_matrices_of_a_hybrid_layer(artifacts):
    config = open_artifact(artifacts["qwen3_next"]).config  # 4 heads over 2 KV heads; GDN 4 key, 8 value heads
    plan = ShardPlan(config, 1, 4)
    attention = "model.layers.3.self_attn"
    # One gated query head (query|gate, 2 x 16 rows); KV head 0, which query heads 0 and 1 read.
    assert plan.shards[f"{attention}.qkv_proj.weight"] == Split(0, ((32, 64), (128, 144), (160, 176)))
    assert plan.shards[f"{attention}.o_proj.weight"] == Split(1, ((16, 32),))
    gdn = "model.layers.0.linear_attn"
    q, k, v = (16, 32), (80, 96), (160, 192)  # key head 1 of q and k, value heads 2-3 of v
    assert plan.shards[f"{gdn}.in_proj.weight"] == Split(0, (q, k, v, (288, 320), (386, 388), (394, 396)))
    assert plan.shards[f"{gdn}.conv1d.weight"] == Split(0, (q, k, v))
    assert plan.shards[f"{gdn}.A_log"] == Split(0, ((2, 4),))
    assert plan.shards[f"{gdn}.out_proj.weight"] == Split(1, ((32, 64),))
    experts = "model.layers.0.mlp.experts"
    assert plan.shards[f"{experts}.gate_up_proj"] == Split(1, ((8, 16), (40, 48)))
    assert plan.shards[f"{experts}.down_proj"] == Split(2, ((8, 16),))
    # Replicated: norms, the router, the shared expert's gate, embeddings.
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight",
                 f"{gdn}.norm.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert name not in plan.shards
    local = local_config(config, 4)
    assert (local.num_attention_heads, local.num_key_value_heads, local.linear_num_key_heads,
            local.linear_num_value_heads, local.moe_intermediate_size) == (1, 1, 1, 2, 8)  # fmt: skip


def test_row_parallel_biases_stay_on_rank_0(artifacts):
    config = open_artifact(artifacts["llama"]).config
    plans = [ShardPlan(config, rank, 2) for rank in range(2)]
    assert plans[0].shards["model.layers.0.self_attn.o_proj.bias"] == LeaderOnly()
    assert plans[0].shards["model.layers.0.mlp.down_proj.bias"] == LeaderOnly()
    bias = torch.arange(1.0, 65.0)
    assert torch.equal(plans[0].shard("model.layers.0.mlp.down_proj.bias", bias), bias)
    assert not plans[1].shard("model.layers.0.mlp.down_proj.bias", bias).any()
    # q/k/v biases are column-parallel, split like their rows.
    assert isinstance(plans[1].shards["model.layers.0.self_attn.qkv_proj.bias"], Split)


def _hybrid(**changes) -> ModelConfig:
    base = ModelConfig(
        model_type="qwen3_5_text", family="qwen3_5", vocab_size=64, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        layer_types=("linear_attention", "full_attention"), linear_num_key_heads=4, linear_num_value_heads=8,
    )  # fmt: skip
    return base.replace(**changes)


@pytest.mark.parametrize(
    "changes, size, problem",
    [
        ({}, 2, None),
        ({}, 4, None),  # 2 KV heads, each on two ranks
        ({}, 8, "its Gated DeltaNet key heads (4) cannot be divided among 8 ranks"),
        ({"num_attention_heads": 6}, 4, "its attention heads (6) cannot be divided among 4 ranks"),
        ({"num_key_value_heads": 3, "num_attention_heads": 12}, 2,
         "its KV heads (3) can neither be divided among 2 ranks nor divide them"),
        ({"intermediate_size": 100}, 8, "its MLP intermediate size (100) cannot be divided among 8 ranks"),
        ({"linear_num_key_heads": 8, "linear_num_value_heads": 12}, 8,
         "its Gated DeltaNet value heads (12) cannot be divided among 8 ranks"),
        ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 30, "shared_expert_intermediate_size": 32},
         4, "its expert intermediate size (30) cannot be divided among 4 ranks"),
    ],
)  # fmt: skip
def test_what_does_not_split_is_named(changes, size, problem):
    assert tensor_parallel_problem(_hybrid(**changes), size) == problem
