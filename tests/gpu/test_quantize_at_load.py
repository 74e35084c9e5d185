"""--quantize fp8|nvfp4 at the real shapes on the GPU: a random-weight bf16 checkpoint of the 27B's
(and the 35B-A3B's) first four layers, every tensor at its real shape (3 Gated DeltaNet layers, one
attention layer, the 248,320-row embedding and lm_head), loads quantized with a device peak of at
most the quantized model plus one row chunk's workspace, and holds the bits of the same
checkpoint loaded in bf16 and quantized after. The full models cannot be written to this disk;
the bound holds layer by layer, so the slice shows it (the full models' figures are checked on
the meta device in tests/models/test_quantize_at_load.py)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from ninfer.artifact import open_artifact
from ninfer.bench.checkpoint import write_random_checkpoint
from ninfer.engine.builder import model_bytes
from ninfer.models.loader import QUANTIZE_AT_LOAD
from ninfer.models.quant.fp8 import Fp8Linear
from ninfer.models.quant.fp8_experts import Fp8Experts
from ninfer.models.quant.nvfp4 import Nvfp4Linear
from ninfer.models.quant.row_chunks import workspace_bytes
from tests.models.test_quantize_at_load import assert_same_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NUM_LAYERS = 4
SLACK_BYTES = 16 << 20  # the allocator's 512-byte rounding and the loader's small tensors (rotary tables)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Shape -> its checkpoint, written on first use."""
    written = {}

    def checkpoint(shape: str):
        if shape not in written:
            written[shape] = write_random_checkpoint(shape, tmp_path_factory.mktemp(shape), device="cuda",
                                                     num_layers=NUM_LAYERS)
            gc.collect()
            torch.cuda.empty_cache()
        return written[shape]

    return checkpoint


def _largest_row(model: nn.Module) -> int:
    """The longest row any quantized module's weight was quantized from."""
    rows = [m.in_features for m in model.modules() if isinstance(m, (Fp8Linear, Nvfp4Linear))]
    rows += [m.down_proj.shape[-1] for m in model.modules() if isinstance(m, Fp8Experts)]
    rows += [m.gate_up_proj.shape[-1] for m in model.modules() if isinstance(m, Fp8Experts)]
    return max(rows)


def _quantized_bf16_bytes(model: nn.Module) -> int:
    """What the quantized modules' weights took in bf16."""
    return 2 * sum(
        m.gate_up_proj.numel() + m.down_proj.numel() if isinstance(m, Fp8Experts) else m.out_features * m.in_features
        for m in model.modules()
        if isinstance(m, (Fp8Linear, Nvfp4Linear, Fp8Experts))
    )


# The 35B-A3B in NVFP4 quantizes only its small attention and shared-expert projections (its
# experts stay bf16), fewer bytes than the workspace: nothing there to tell the bound from the old peak.
@pytest.mark.parametrize("shape, quantize", [("27b", "fp8"), ("27b", "nvfp4"), ("35b-a3b", "fp8")])
def test_the_load_peak_is_the_quantized_model_plus_one_chunk(checkpoints, shape: str, quantize: str) -> None:
    artifact = open_artifact(checkpoints(shape))
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ours = artifact.load_model(dtype=torch.bfloat16, device="cuda", progress=False, quantize=quantize)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    quantized = model_bytes(ours)
    workspace = workspace_bytes(largest_row=_largest_row(ours))
    assert peak <= quantized + workspace + SLACK_BYTES, (
        f"peak {peak / 2**30:.3f} GiB: model {quantized / 2**30:.3f} GiB + "
        f"{(peak - quantized) / 2**20:.0f} MiB beyond it; the bound allows {workspace / 2**20:.0f} MiB"
    )
    # Holding the quantized layers' bf16 weights (as loading then quantizing does) would exceed it.
    assert _quantized_bf16_bytes(ours) > 4 * (workspace + SLACK_BYTES)

    expected = artifact.load_model(dtype=torch.bfloat16, device="cuda", progress=False)
    assert QUANTIZE_AT_LOAD[quantize](expected) > 0
    assert_same_model(ours, expected)
