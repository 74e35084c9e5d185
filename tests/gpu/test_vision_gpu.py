"""Images on the GPU: the engine with captured decode graphs against the same engine eager, and
the bf16 tower against transformers' fp32 tower, on the tiny random VL artifact (bf16)."""

from __future__ import annotations

import pytest
import torch

from ninfer.artifact import open_artifact
from ninfer.config import EngineConfig
from ninfer.engine.core import EngineCore
from ninfer.models.vision_loader import load_vision_tower
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.engine.test_engine_generation import run_engine
from tests.engine.test_engine_vision import png, prompt_with, request

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, needs_cuda]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = make_tiny_qwen3_5(tmp_path_factory.mktemp("vl-gpu"), vision=True, dtype="bfloat16")
    artifact = open_artifact(path)
    model = artifact.load_model(dtype=torch.bfloat16, device="cuda")
    return artifact, model, load_vision_tower(artifact, "cuda", torch.bfloat16)


def test_graph_decode_of_an_image_request_equals_eager(vl):
    artifact, model, tower = vl
    one = prompt_with([(png(1), 4)], text=[1000, 1001], tail=[2000])
    two = prompt_with([(png(2, (256, 256)), 2), (png(3), 1)], text=[1002], tail=[2001])
    results = []
    for graphs in (True, False):
        core = EngineCore(
            model, artifact.tokenizer,
            EngineConfig(max_concurrency=2, prefill_chunk=64, max_context=512, prefix_reuse=False,
                         cuda_graphs=graphs, device="cuda"),
            vision_tower=tower,
        )
        assert (core.runner.graphs is not None) == graphs
        got = run_engine(core, {0: [request("one", *one)], 1: [request("two", *two)]})
        results.append({rid: toks for rid, (toks, _) in got.items()})
        assert core.runner.media.num_encoded_items == 3
    assert results[0] == results[1]


def test_bf16_tower_on_the_gpu_is_as_close_to_fp32_as_transformers_bf16(vl):
    import transformers as tf
    from safetensors.torch import load_file

    artifact, _, tower = vl
    _, media = prompt_with([(png(4), 1)], text=[1000], tail=[])
    item = media[0]
    patches = torch.frombuffer(bytearray(item.patches), dtype=torch.bfloat16).view(item.num_patches, -1)
    tensors = load_file(artifact.path / "model.safetensors")
    reference = tf.Qwen3_5VisionModel(tf.Qwen3_5VisionConfig(**artifact.hf_config["vision_config"])).eval()
    reference.load_state_dict(
        {k.removeprefix("model.visual."): v.float() for k, v in tensors.items() if k.startswith("model.visual.")}
    )
    grid = torch.tensor([item.grid_thw])
    with torch.no_grad():
        want = reference(patches.float(), grid_thw=grid).pooler_output
        ref_bf16 = reference.to("cuda", torch.bfloat16)(patches.cuda(), grid_thw=grid.cuda()).pooler_output
        ours = tower(patches.cuda(), [item.grid_thw])
    ours_error = (ours.float().cpu() - want).abs().max().item()
    ref_error = (ref_bf16.float().cpu() - want).abs().max().item()
    assert ours_error <= 1.5 * ref_error + 1e-3, (ours_error, ref_error)


def test_kv_capacity_auto_sets_aside_the_towers_encode_peak_and_the_kept_rows(tmp_path_factory):
    from ninfer.engine.builder import EngineSpec, build_engine_core
    from ninfer.engine.media_embeddings import DEFAULT_CAPACITY_TOKENS

    path = make_tiny_qwen3_5(tmp_path_factory.mktemp("vl-auto"), vision=True, dtype="bfloat16")
    engine = EngineConfig(device="cuda", max_context=4096, max_concurrency=2, vision=True)
    core = build_engine_core(EngineSpec(str(path), engine, kv_capacity_auto=True))
    ledger = core.memory_ledger
    hidden = open_artifact(path).config.hidden_size
    assert ledger["media_rows"] == DEFAULT_CAPACITY_TOKENS * hidden * 2
    # 131,072 patch rows of 1536 bf16 values are 384 MiB before the tower's first layer.
    assert ledger["vision_encode"] >= 131_044 * 1536 * 2
    assert ledger["kv_budget"] == max(0, ledger["free_after_weights"] - ledger["headroom"] - ledger["worst_step"]
                                      - ledger["decode_graphs"] - ledger["state_slots"] - ledger["vision_encode"]
                                      - ledger["media_rows"])
