"""FP8 routed experts in models: Fp8Experts, quantize_fp8_ on an MoE model, and Qwen FP8
checkpoints whose experts load as stored (fused 3-D and per expert, 128 x 128 blocks and row
blocks). CPU paths (the kernels' reference); the kernels are tests/kernels/test_moe_fp8_triton.py.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ninfer.artifact import open_artifact
from ninfer.kernels.gemv.ref import dequantize
from ninfer.kernels.moe import ref
from ninfer.models.layers.moe import Experts
from ninfer.models.loader import load_model
from ninfer.models.quant.fp8 import FP8, SCALE_BLOCK, Fp8Linear, expand_block_rows, quantize_fp8_
from ninfer.models.quant.fp8_experts import Fp8Experts
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.models.fp8_experts_checkpoint import fp8_moe_checkpoint
from tests.models.helpers import run_full

PROMPT = torch.arange(1000, 1024)
# What FP8 experts move the logits by, relative norm, against the same model with its experts
# unquantized: each expert weight within 2^-4 of its row's amax (e4m3's 3 mantissa bits); the
# tiny model's experts add little to its residual stream (observed ~4e-4). The whole model in
# bf16 moves them by ~5e-2, and the FP8 experts must move them less.
FP8_EXPERTS_LOGITS_REL = 1e-2


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fp8-experts")


def _experts(num_experts: int, hidden: int, inter: int, seed: int) -> Experts:
    experts = Experts(num_experts, hidden, inter)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight.copy_(torch.randn(weight.shape, generator=gen) * weight.shape[-1] ** -0.5)
    return experts


def _dequantized(module: Fp8Experts, projection: str) -> torch.Tensor:
    weight, scale = getattr(module, projection), module.scale_of(projection)
    return torch.stack([dequantize(w, s) for w, s in zip(weight, scale)])


def _with_dequantized_experts(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose FP8 experts are plain Experts holding their exact fp32 dequantization."""
    model = copy.deepcopy(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, Fp8Experts):
            num_experts, two_inter, hidden = module.gate_up_proj.shape
            experts = Experts(num_experts, hidden, two_inter // 2)
            with torch.no_grad():
                experts.gate_up_proj.copy_(_dequantized(module, "gate_up_proj"))
                experts.down_proj.copy_(_dequantized(module, "down_proj"))
            parent_name, _, child_name = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child_name, experts)
    return model


def _fp8_experts(model: torch.nn.Module) -> dict[str, Fp8Experts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Experts)}


def _relative_error(logits: torch.Tensor, expected: torch.Tensor) -> float:
    return ((logits.float() - expected).norm() / expected.norm()).item()


def test_from_experts_quantizes_each_output_row() -> None:
    experts = _experts(6, 200, 96, seed=0)
    fp8 = Fp8Experts.from_experts(experts)
    assert fp8.gate_up_proj.dtype == fp8.down_proj.dtype == FP8
    assert fp8.gate_up_proj_scale.shape == (6, 192) and fp8.down_proj_scale.shape == (6, 200)
    assert fp8.rows_per_block("gate_up_proj") is None
    for projection in ("gate_up_proj", "down_proj"):
        original = getattr(experts, projection)
        error = (_dequantized(fp8, projection) - original).abs().amax(dim=-1)
        assert (error <= original.abs().amax(dim=-1) * 2**-4).all()  # e4m3: 3 mantissa bits
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 200, generator=gen)
    weights, ids = ref.route(torch.randn(9, 6, generator=gen), 2, True)
    expected = ref.fused_experts(x, weights, ids, _dequantized(fp8, "gate_up_proj"), _dequantized(fp8, "down_proj"))
    assert torch.equal(fp8(x, weights, ids), expected)


def test_placeholder_scale_layouts() -> None:
    experts = _experts(4, 200, 96, seed=2)
    blocks = Fp8Experts.placeholder(experts, SCALE_BLOCK)
    assert blocks.gate_up_proj_scale.shape == (4, 2, 2) and blocks.down_proj_scale.shape == (4, 2, 1)
    assert blocks.rows_per_block("gate_up_proj") == blocks.rows_per_block("down_proj") == SCALE_BLOCK
    rows = Fp8Experts.placeholder(experts, 1)
    assert rows.gate_up_proj_scale.shape == (4, 192, 2) and rows.down_proj_scale.shape == (4, 200, 1)
    assert rows.rows_per_block("down_proj") == 1


def test_quantize_fp8_turns_moe_experts_fp8(root) -> None:
    model = open_artifact(make_tiny_qwen3_5(root, moe=True)).load_model(dtype=torch.float32, progress=False)
    quantized = copy.deepcopy(model)
    replaced = quantize_fp8_(quantized)
    experts = _fp8_experts(quantized)
    assert len(experts) == model.config.num_hidden_layers and not any(isinstance(m, Experts) for m in quantized.modules())
    assert replaced == len(experts) + sum(isinstance(m, Fp8Linear) for m in quantized.modules())
    assert all(m.rows_per_block("gate_up_proj") is None for m in experts.values())
    assert type(quantized.model.layers[0].mlp.gate) is type(model.model.layers[0].mlp.gate)  # the router stays
    # The same model with its experts unquantized (its Linear layers still FP8).
    fp8_linear_only = copy.deepcopy(quantized)
    for name in experts:
        parent_name, _, child_name = name.rpartition(".")
        setattr(fp8_linear_only.get_submodule(parent_name), child_name, model.get_submodule(name))
    logits = run_full(quantized, PROMPT)
    error = _relative_error(logits, run_full(fp8_linear_only, PROMPT))
    bf16_error = _relative_error(run_full(copy.deepcopy(model).to(torch.bfloat16), PROMPT), run_full(model, PROMPT))
    assert error < FP8_EXPERTS_LOGITS_REL and error < bf16_error
    # The FP8 experts compute exactly what they hold.
    torch.testing.assert_close(run_full(_with_dequantized_experts(quantized), PROMPT), logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("inter", [32, 128])  # 32: per-expert gate and up share 128-row blocks
def test_fp8_checkpoint_experts_load_as_stored(root, inter: int) -> None:
    directory = fp8_moe_checkpoint(root, inter)
    stored = load_file(directory / "model.safetensors")
    model = open_artifact(directory).load_model(dtype=torch.float32, progress=False, keep_fp8=True)
    experts = _fp8_experts(model)
    config = model.config
    assert sorted(experts) == sorted(
        [f"model.layers.{i}.mlp.experts" for i in range(config.num_hidden_layers)] + ["mtp.layers.0.mlp.experts"]
    )
    # Fused trunk experts: the stored bits and 128 x 128 block scales.
    trunk = experts["model.layers.0.mlp.experts"]
    for projection in ("gate_up_proj", "down_proj"):
        name = f"model.language_model.layers.0.mlp.experts.{projection}"
        assert trunk.rows_per_block(projection) == SCALE_BLOCK
        assert torch.equal(getattr(trunk, projection).view(torch.uint8), stored[name].view(torch.uint8))
        assert torch.equal(trunk.scale_of(projection), stored[name + "_scale_inv"])
    # Per-expert MTP experts: each in its slice of the fused tensors, its scales likewise, as
    # 128 x 128 blocks where gate and up line up with them, else as row blocks.
    mtp = experts["mtp.layers.0.mlp.experts"]
    rows_per_block = SCALE_BLOCK if inter % SCALE_BLOCK == 0 else 1
    assert mtp.rows_per_block("gate_up_proj") == mtp.rows_per_block("down_proj") == rows_per_block

    def expected_scales(scale_inv: torch.Tensor, rows: int) -> torch.Tensor:
        return scale_inv if rows_per_block == SCALE_BLOCK else expand_block_rows(scale_inv, rows)

    for e in range(config.num_experts):
        parts = {proj: f"mtp.layers.0.mlp.experts.{e}.{proj}_proj.weight" for proj in ("gate", "up", "down")}
        stacked = torch.cat([stored[parts["gate"]], stored[parts["up"]]])
        assert torch.equal(mtp.gate_up_proj[e].view(torch.uint8), stacked.view(torch.uint8))
        assert torch.equal(mtp.down_proj[e].view(torch.uint8), stored[parts["down"]].view(torch.uint8))
        gate_up_scales = [expected_scales(stored[parts[p] + "_scale_inv"], inter) for p in ("gate", "up")]
        assert torch.equal(mtp.gate_up_proj_scale[e], torch.cat(gate_up_scales))
        assert torch.equal(mtp.down_proj_scale[e], expected_scales(stored[parts["down"] + "_scale_inv"], config.hidden_size))
    # The logits of the same model with the experts dequantized exactly.
    torch.testing.assert_close(
        run_full(model, PROMPT), run_full(_with_dequantized_experts(model), PROMPT), atol=1e-5, rtol=1e-5
    )


def test_without_keep_fp8_experts_are_dequantized(root) -> None:
    directory = fp8_moe_checkpoint(root, 128)
    model = open_artifact(directory).load_model(dtype=torch.float32, progress=False, keep_fp8=False)
    assert not _fp8_experts(model) and isinstance(model.model.layers[0].mlp.experts, Experts)


def test_an_unquantized_part_of_fp8_experts_is_quantized_into_their_blocks(root) -> None:
    """A checkpoint whose fused down_proj is bf16 beside an FP8 gate_up_proj."""
    artifact = open_artifact(fp8_moe_checkpoint(root, 128))
    down = "model.language_model.layers.0.mlp.experts.down_proj"
    fp8_weights = {name: shape for name, shape in artifact.fp8_weights.items() if name != down}
    tensors = list(artifact.weights(keep_fp8=True))
    bf16_down = next(t for name, t in artifact.weights() if name == down)
    tensors = [(n, bf16_down if n == down else t) for n, t in tensors if n != down + "_scale_inv"]
    model = load_model(artifact.config, tensors, dtype=torch.float32, progress=False, fp8_weights=fp8_weights)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, Fp8Experts) and experts.rows_per_block("down_proj") == SCALE_BLOCK
    error = (_dequantized(experts, "down_proj") - bf16_down.float()).abs().amax()
    assert error <= bf16_down.float().abs().amax() * 2**-4
