"""The model identity that names a kernel manifest: a checkpoint's ids, limits, rotary base and
depth share their architecture's manifest; shapes, layer kinds and weight formats do not."""

from ninfer.bench.checkpoint import shape_config
from ninfer.engine.start_compiles import model_identity


def _identity(config, dtype="auto", quantize=None, stored="plain"):
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
