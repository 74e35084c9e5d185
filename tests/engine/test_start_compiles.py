"""The model identity that names a kernel manifest: a checkpoint's ids, limits, rotary base and
depth share their architecture's manifest; shapes, layer kinds and weight formats do not."""

from ninfer.bench.checkpoint import shape_config
from ninfer.bench.shapes import vision_shape_config
from ninfer.engine.builder import resolve_dtype
from ninfer.engine.start_compiles import model_identity
from ninfer.kernels import compile_manifest
from ninfer.kernels.compile_manifest import KernelManifest, manifest_key
from ninfer.models.config import ModelConfig

SM_90 = {"backend": "cuda", "arch": 90, "warp_size": 32}


def _identity(config, dtype="bfloat16", quantize=None, stored="plain"):
    return model_identity(config, dtype, quantize, stored)


def test_values_the_kernels_read_share_a_manifest():
    _, config = shape_config("27b")
    same = config.replace(eos_token_id=(7,), rope_theta=1e6, max_position_embeddings=32768, rms_norm_eps=1e-5,
                          num_hidden_layers=8, layer_types=config.layer_types[:8])  # fmt: skip
    assert _identity(same) == _identity(config)


def test_shapes_and_formats_each_name_their_own():
    _, config = shape_config("27b")
    _, moe = shape_config("35b-a3b")
    base = _identity(config)
    assert _identity(moe) != base
    assert _identity(config.replace(hidden_size=4096)) != base
    assert _identity(config.replace(layer_types=("full_attention",) * 64)) != base
    assert _identity(config, dtype="float16") != base
    assert _identity(config, quantize="fp8") != base
    assert _identity(config, stored="nvfp4") != base


def test_the_packaged_27b_manifest_is_found_for_the_released_checkpoints_config():
    """Qwen's released 27B config (the vision-language composite, an MTP layer, its own ids) under
    --dtype auto or bfloat16 on sm_90 with Triton 3.6 names the packaged manifest, as the
    benchmarks' text-only checkpoint of the same shapes does."""
    hf, bench = shape_config("27b")
    released = ModelConfig.from_hf({
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {**hf, "mtp_num_hidden_layers": 1, "eos_token_id": 248044},
        "vision_config": vision_shape_config("27b"), "image_token_id": 248056, "tie_word_embeddings": False,
    })
    keys = set()
    for config in (bench, released):
        for asked in ("auto", "bfloat16"):
            dtype = str(resolve_dtype(asked, config.torch_dtype, "cuda:0")).removeprefix("torch.")
            keys.add(manifest_key(model_identity(config, dtype, None, "plain"), "3.6.0", SM_90))
    (key,) = keys
    packaged = KernelManifest.load(compile_manifest.PACKAGED / f"{key}.json.gz")
    assert packaged is not None and packaged.usable_with("3.6.0", SM_90) and len(packaged.specializations) > 100
