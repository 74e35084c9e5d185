"""Images through the engine (vision tower, media rows, MRoPE positions) against transformers'
Qwen3_5ForConditionalGeneration greedy generate, on the tiny random VL artifact in fp32.

The image goes through the real preparation (Pillow decode, smart resize, bf16 patches); both
models get the same bf16 patch values. Also: prompt chunks that split an image's tokens,
two requests batched, prefix reuse through an image (the tower is not run again) and a
different image of the same size never matching past its first token.
"""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image

from ninfer.artifact import open_artifact
from ninfer.config import EngineConfig
from ninfer.contract.media import PATCH_VALUES, MediaInput
from ninfer.contract.request import EngineRequest
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.frontend.media_expansion import patch_bytes
from ninfer.media.image import ImageSettings, prepare_image
from ninfer.models.vision_loader import load_vision_tower
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.engine.test_engine_generation import run_engine

VISION_START, VISION_END, IMAGE_PAD = 248053, 248054, 248056
MAX_NEW = 8


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = make_tiny_qwen3_5(tmp_path_factory.mktemp("vl"), vision=True, dtype="float32")
    artifact = open_artifact(path)
    model = artifact.load_model(dtype=torch.float32, device="cpu")
    tower = load_vision_tower(artifact, "cpu", torch.float32)
    hf = tf.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return artifact, model, tower, hf


def png(seed: int, size=(300, 260)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def image_item(data: bytes, start: int) -> MediaInput:
    packed = prepare_image(data, ImageSettings())
    return MediaInput("image", hashlib.sha256(data).hexdigest(), packed.grid_thw, [start], patch_bytes(packed.patches))


def prompt_with(items_at: list[tuple[bytes, int]], text: list[int], tail: list[int]) -> tuple[list[int], list[MediaInput]]:
    """text, then per image <|vision_start|> pads <|vision_end|> and some text, then tail."""
    ids, media = list(text), []
    for data, after in items_at:
        ids.append(VISION_START)
        item = image_item(data, len(ids))
        media.append(item)
        ids += [IMAGE_PAD] * item.num_tokens + [VISION_END] + list(range(300, 300 + after))
    return ids + tail, media


def hf_greedy(hf, ids: list[int], media: list[MediaInput], num_valid_tokens: int) -> list[int]:
    """transformers' greedy tokens; like the engine, never an embedding row past the tokenizer's ids."""
    patches = torch.cat([
        torch.frombuffer(bytearray(m.patches), dtype=torch.bfloat16).view(m.num_patches, PATCH_VALUES) for m in media
    ]).float()
    input_ids = torch.tensor([ids])
    out = hf.generate(
        input_ids, pixel_values=patches, image_grid_thw=torch.tensor([m.grid_thw for m in media]),
        mm_token_type_ids=(input_ids == IMAGE_PAD).int(),
        max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, eos_token_id=None,
        suppress_tokens=list(range(num_valid_tokens, hf.config.text_config.vocab_size)),
    )
    return out[0, len(ids):].tolist()


def request(rid: str, ids: list[int], media: list[MediaInput]) -> EngineRequest:
    return EngineRequest(rid, ids, SamplingParams(temperature=0.0), max_new_tokens=MAX_NEW, media=media)


def test_an_image_prompt_matches_transformers_whole_and_in_chunks_that_split_the_image(vl):
    artifact, model, tower, hf = vl
    ids, media = prompt_with([(png(1), 5)], text=[1000, 1001, 1002], tail=[2000, 2001])
    assert media[0].grid_thw == (1, 16, 18) and media[0].num_tokens == 72  # 300x260 px -> 288x256 -> 72 tokens
    want = hf_greedy(hf, ids, media, artifact.tokenizer.vocab_size)
    for chunk in (4096, 13):  # 13: chunks end inside the image's run, in its middle rows
        core = EngineCore(model, artifact.tokenizer, EngineConfig(prefill_chunk=chunk, max_context=512),
                          vision_tower=tower)
        got, final = run_engine(core, {0: [request("a", ids, media)]})["a"]
        assert got == want, f"prefill chunk {chunk}"
        assert final.prompt_tokens == len(ids)
        assert core.runner.media.num_encoded_items == 1  # encoded once, its rows kept across chunks


def test_two_image_requests_batched_and_two_images_in_one_prompt(vl):
    artifact, model, tower, hf = vl
    one = prompt_with([(png(2), 3)], text=[1000], tail=[2000])
    two = prompt_with([(png(3, (256, 256)), 2), (png(4, (260, 300)), 1)], text=[1001, 1002], tail=[2001])
    valid = artifact.tokenizer.vocab_size
    want = {"one": hf_greedy(hf, *one, valid), "two": hf_greedy(hf, *two, valid)}
    config = EngineConfig(max_concurrency=2, prefill_chunk=64, max_context=512, prefix_reuse=False)
    core = EngineCore(model, artifact.tokenizer, config,
                      vision_tower=tower)
    got = run_engine(core, {0: [request("one", *one)], 2: [request("two", *two)]})
    assert {rid: toks for rid, (toks, _) in got.items()} == want
    assert core.pool_accounting()["kv_pages_used"] == 0


def test_prefix_reuse_through_an_image_skips_the_tower_and_a_different_image_does_not_match(vl):
    artifact, model, tower, hf = vl
    ids, media = prompt_with([(png(5), 4)], text=[1000, 1001], tail=[2000])
    core = EngineCore(model, artifact.tokenizer, EngineConfig(max_concurrency=1, prefill_chunk=64, max_context=512),
                      vision_tower=tower)
    first, final = run_engine(core, {0: [request("t1", ids, media)]})["t1"]
    assert final.timings.vision_seconds > 0
    follow = ids + first + [2100, 2101]
    encoded = core.runner.media.num_encoded_items
    got, final = run_engine(core, {0: [request("t2", follow, media)]})["t2"]
    assert final.cached_tokens == len(ids) + len(first) - 1
    assert core.runner.media.num_encoded_items == encoded  # the image lay inside the reused prefix
    assert final.timings.vision_seconds == 0.0
    assert got == hf_greedy(hf, follow, media, artifact.tokenizer.vocab_size)

    # Same size, other pixels: identical placeholder ids, but the cache compares media by content.
    other_ids, other = prompt_with([(png(6), 4)], text=[1000, 1001], tail=[2000])
    assert other_ids == ids and other[0].grid_thw == media[0].grid_thw
    other_follow = other_ids + first + [2100, 2101]
    got, final = run_engine(core, {0: [request("t3", other_follow, other)]})["t3"]
    assert final.cached_tokens <= media[0].token_starts[0]
    assert got == hf_greedy(hf, other_follow, other, artifact.tokenizer.vocab_size)


def test_a_video_prompt_matches_transformers(vl):
    """A video: one time-stamped block of pads per temporal patch (MediaExpansion), attention per
    frame in the tower, positions per frame group."""
    from ninfer.frontend.media_expansion import MediaExpansion, VisionTokens
    from ninfer.frontend.prompt_builder import PreparedPrompt
    from ninfer.media.payload import PreparedMedia
    from ninfer.media.source import Modality
    from ninfer.media.video import VideoSettings, prepare_video
    from tests.media.media_samples import video_bytes

    artifact, model, tower, hf = vl
    data = video_bytes(64, 48, fps=10, frame_count=30)
    packed = prepare_video(data, VideoSettings())
    assert packed.grid_thw[0] >= 2 and packed.timestamps_s
    prepared = PreparedMedia(Modality.VIDEO, hashlib.sha256(data).hexdigest(), packed.grid_thw, packed.patches,
                             packed.timestamps_s)
    expansion = MediaExpansion(VisionTokens(VISION_START, VISION_END, IMAGE_PAD, 248057), artifact.tokenizer.encode)
    rendered = [1000, 1001, VISION_START, 248057, VISION_END, 2000, 2001]
    out = expansion.expand(PreparedPrompt(rendered, False, [], None, None), [prepared])
    ids, (item,) = out.token_ids, out.media
    assert len(item.token_starts) == packed.grid_thw[0]

    input_ids = torch.tensor([ids])
    expected = hf.generate(
        input_ids, pixel_values_videos=packed.patches.float(), video_grid_thw=torch.tensor([packed.grid_thw]),
        mm_token_type_ids=2 * (input_ids == 248057).int(), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
        do_sample=False, pad_token_id=0, eos_token_id=None,
        suppress_tokens=list(range(artifact.tokenizer.vocab_size, hf.config.text_config.vocab_size)),
    )[0, len(ids):].tolist()
    core = EngineCore(model, artifact.tokenizer, EngineConfig(prefill_chunk=32, max_context=1024), vision_tower=tower)
    got, _ = run_engine(core, {0: [request("v", ids, [item])]})["v"]
    assert got == expected


def test_decode_graph_rows_add_the_rope_offset(vl, monkeypatch):
    """The decode graphs' static buffers (each graph replaced by a direct call of its region, as
    in tests/gpu/test_cuda_graphs.py) carry a request's rope offset: after every step the slot
    logits equal an eager engine's."""
    import ninfer.models.layers.attention as attention
    from tests.gpu.test_cuda_graphs import _count_replays, _DirectGraphs, device_lengths_only

    monkeypatch.setattr(attention, "paged_attention", device_lengths_only)
    artifact, model, tower, hf = vl
    ids, media = prompt_with([(png(7), 3)], text=[1000], tail=[2000])
    config = EngineConfig(prefill_chunk=64, max_context=512, prefix_reuse=False)
    eager = EngineCore(model, artifact.tokenizer, config, vision_tower=tower)
    graph = EngineCore(model, artifact.tokenizer, config, vision_tower=tower)
    runner = graph.runner
    runner.graphs = _DirectGraphs(
        model, runner.kv_cache, runner.state_cache, runner.slot_logits, runner.num_valid_tokens,
        (1,), -(-512 // runner.kv_cache.page_size), runner.sampler,
    )
    runner.graphs.capture()
    replays = _count_replays(runner.graphs)
    assert graph.add_request(request("g", ids, media)) == eager.add_request(request("g", ids, media)) == []
    tokens = []
    while graph.has_work:
        outs_graph, outs_eager = graph.step(), eager.step()
        assert [o.new_token_ids for o in outs_graph] == [o.new_token_ids for o in outs_eager]
        torch.testing.assert_close(runner.slot_logits, eager.runner.slot_logits, rtol=0, atol=1e-5)
        tokens += [t for o in outs_graph for t in o.new_token_ids]
    assert replays.get(1, 0) >= MAX_NEW - 2  # the decode rounds went through the graph's buffers
    assert tokens == hf_greedy(hf, ids, media, artifact.tokenizer.vocab_size)


def test_the_moe_trunk_with_an_image_matches_transformers(tmp_path_factory):
    """The 35B-A3B layout: the same tower in front of the MoE trunk."""
    path = make_tiny_qwen3_5(tmp_path_factory.mktemp("vl-moe"), moe=True, vision=True, dtype="float32")
    artifact = open_artifact(path)
    model = artifact.load_model(dtype=torch.float32, device="cpu")
    tower = load_vision_tower(artifact, "cpu", torch.float32)
    hf = tf.Qwen3_5MoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ids, media = prompt_with([(png(8), 2)], text=[1000], tail=[2000])
    core = EngineCore(model, artifact.tokenizer, EngineConfig(prefill_chunk=32, max_context=512), vision_tower=tower)
    got, _ = run_engine(core, {0: [request("m", ids, media)]})["m"]
    assert got == hf_greedy(hf, ids, media, artifact.tokenizer.vocab_size)
