"""NVFP4 routed experts of MoE models: `pack --weights nvfp4` stores them in the container and they
load back as packed; a ModelOpt NVFP4 checkpoint's per-expert projections are kept as stored
(codes and block scales bit for bit, each projection's global scale on its rows); a model with
NVFP4 experts computes what its dequantized weights compute."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ninfer.artifact import open_artifact
from ninfer.artifact.ninfer_file import verify_container
from ninfer.artifact.packer import pack
from ninfer.kernels.nvfp4_gemv.ref import E2M1_VALUES, unpack_codes
from ninfer.models.layers.moe import Experts
from ninfer.models.quant.nvfp4 import quantize_nvfp4_
from ninfer.models.quant.nvfp4_experts import Nvfp4Experts
from ninfer.models.runtime_layout import NVFP4_EXPERTS, runtime_tensors
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from ninfer.testing.tiny_quantized import modelopt_nvfp4_copy
from tests.artifact.test_ninfer_file import _same_tensors
from tests.models.helpers import run_full

TRUNK, MTP = "model.layers.0.mlp.experts", "mtp.layers.0.mlp.experts"
PROMPT = torch.arange(2000, 2016)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("nvfp4-experts")


@pytest.fixture(scope="module")
def tiny_moe(root):
    return make_tiny_qwen3_5(root, moe=True, mtp=True)


def test_nvfp4_packing_stores_and_reloads_nvfp4_experts(root, tiny_moe) -> None:
    out = root / "tiny-moe-nvfp4.ninfer"
    pack(tiny_moe, out, weights="nvfp4", progress=False)
    packed = open_artifact(out)
    modules = packed.manifest["weights"]["modules"]
    assert modules[TRUNK] == modules[MTP] == {"kind": NVFP4_EXPERTS}
    assert verify_container(out, progress=False) == []
    # The server's own build of the source with --quantize nvfp4 holds the same bits.
    expected = open_artifact(tiny_moe).load_model(dtype=torch.bfloat16, progress=False)
    assert quantize_nvfp4_(expected) > 0
    model = packed.load_model(dtype=torch.bfloat16, progress=False)
    _same_tensors(runtime_tensors(model), runtime_tensors(expected))
    assert isinstance(model.get_submodule(TRUNK), Nvfp4Experts) and isinstance(model.get_submodule(MTP), Nvfp4Experts)
    assert torch.equal(run_full(model, PROMPT), run_full(expected, PROMPT))


def test_a_modelopt_checkpoints_expert_projections_are_kept_as_stored(root, tiny_moe) -> None:
    """The tiny checkpoint fuses its trunk's experts (3-D, stored unquantized) and stores the MTP
    layer's one tensor per expert, which the ModelOpt layout quantizes."""
    nvfp4_dir = modelopt_nvfp4_copy(tiny_moe, root / "tiny-moe-modelopt")
    model = open_artifact(nvfp4_dir).load_model(dtype=torch.float32, progress=False, keep_nvfp4=True)
    experts = model.get_submodule(MTP)
    assert isinstance(experts, Nvfp4Experts)
    assert isinstance(model.get_submodule(TRUNK), Experts)  # stored unquantized, loaded as stored
    stored = load_file(nvfp4_dir / "model.safetensors")
    inter = model.config.moe_intermediate_size
    codes, block_scale, row_scale = experts.operands("gate_up_proj")
    for expert in range(model.config.num_experts):
        for part, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
            name = f"{MTP}.{expert}.{part}.weight"
            assert torch.equal(codes[expert, rows], stored[name])
            assert torch.equal(block_scale[expert, rows].view(torch.uint8), stored[name + "_scale"].view(torch.uint8))
            assert torch.all(row_scale[expert, rows] == stored[name + "_scale_2"])  # each projection its own
        name = f"{MTP}.{expert}.down_proj.weight"
        assert torch.equal(experts.down_proj[expert], stored[name])


def test_nvfp4_experts_compute_what_their_dequantized_weights_compute(tiny_moe) -> None:
    """fp32 activations: the experts' products are the dequantized weights' products, so the
    logits equal those of the same model with plain experts holding the dequantized weights, up
    to summation order."""
    model = open_artifact(tiny_moe).load_model(dtype=torch.float32, progress=False)
    for name, module in list(model.named_modules()):
        if isinstance(module, Experts):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Nvfp4Experts.from_experts(module))
    dense = open_artifact(tiny_moe).load_model(dtype=torch.float32, progress=False)
    for name, module in model.named_modules():
        if isinstance(module, Nvfp4Experts):
            plain = dense.get_submodule(name)
            for projection in ("gate_up_proj", "down_proj"):
                codes, block_scale, row_scale = module.operands(projection)
                weights = [_dequantized(codes[e], block_scale[e], row_scale[e]) for e in range(codes.shape[0])]
                getattr(plain, projection).data = torch.stack(weights)
    out, expected = run_full(model, PROMPT), run_full(dense, PROMPT)
    assert torch.allclose(out, expected, rtol=1e-4, atol=1e-4)


def _dequantized(codes: torch.Tensor, block_scale: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """One expert's fp32 projection, written out from the layout's definition (not the kernels' dequantization)."""
    magnitudes = torch.tensor(E2M1_VALUES)
    codes = unpack_codes(codes)
    values = torch.where(codes >= 8, -magnitudes[codes % 8], magnitudes[codes % 8])
    return values * (block_scale.float() * row_scale[:, None]).repeat_interleave(16, dim=1)
