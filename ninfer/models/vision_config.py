"""VisionConfig: a Qwen3.5-family vision tower's architecture, parsed once from config.json.

The facts live under the composite config's `vision_config` (model_type "qwen3_5_vision" or
"qwen3_5_moe_vision"); the placeholder token ids sit at the config's top level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ninfer.models.config import ConfigError

# Activations of the blocks' MLP we implement, by their HF names.
BLOCK_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
IMAGE_TOKEN_ID = 248_056  # <|image_pad|> of the Qwen3.5 tokenizer, when config.json omits it
VIDEO_TOKEN_ID = 248_057  # <|video_pad|>


@dataclass(frozen=True)
class VisionConfig:
    depth: int  # transformer blocks
    hidden_size: int
    num_heads: int
    intermediate_size: int  # each block's MLP width
    out_hidden_size: int  # the text trunk's hidden size: what the merger emits per merged token
    patch_size: int  # pixels on each side of a patch
    temporal_patch_size: int  # frames stacked in one patch
    spatial_merge_size: int  # patches per side of one merged (LLM) token
    in_channels: int
    num_position_embeddings: int  # rows of the learned square position grid
    hidden_act: str  # the blocks' MLP activation (the merger's GELU is always exact)
    rope_theta: float
    image_token_id: int = IMAGE_TOKEN_ID
    video_token_id: int = VIDEO_TOKEN_ID

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened input patch (channels x frames x pixels x pixels)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches folded into one merged token."""
        return self.spatial_merge_size**2

    @property
    def position_grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> VisionConfig:
        """Parse a composite Qwen3.5 config.json; ConfigError names the missing or unsupported field."""
        vision = hf.get("vision_config")
        if not isinstance(vision, dict):
            raise ConfigError(f"{source}: no vision_config object (a text-only model has no vision tower)")

        def need(key: str) -> Any:
            if vision.get(key) is None:
                raise ConfigError(f"{source}: missing required field vision_config.{key}")
            return vision[key]

        if vision.get("deepstack_visual_indexes"):
            # Qwen3-VL feeds intermediate block outputs into the trunk; Qwen3.5 towers do not.
            raise ConfigError(f"{source}: vision_config.deepstack_visual_indexes is not supported (Qwen3-VL DeepStack)")
        rope = vision.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", "axial")
        if rope_type != "axial":
            raise ConfigError(f"{source}: vision_config.rope_parameters.rope_type {rope_type!r} (only 'axial')")
        config = cls(
            depth=int(need("depth")),
            hidden_size=int(need("hidden_size")),
            num_heads=int(need("num_heads")),
            intermediate_size=int(need("intermediate_size")),
            out_hidden_size=int(need("out_hidden_size")),
            patch_size=int(need("patch_size")),
            temporal_patch_size=int(need("temporal_patch_size")),
            spatial_merge_size=int(need("spatial_merge_size")),
            in_channels=int(vision.get("in_channels") or 3),
            num_position_embeddings=int(need("num_position_embeddings")),
            hidden_act=str(vision.get("hidden_act") or "gelu_pytorch_tanh"),
            rope_theta=float(rope.get("rope_theta", 10_000.0)),
            image_token_id=int(hf.get("image_token_id") or IMAGE_TOKEN_ID),
            video_token_id=int(hf.get("video_token_id") or VIDEO_TOKEN_ID),
        )
        if config.hidden_size % config.num_heads:
            raise ConfigError(f"{source}: vision_config.hidden_size {config.hidden_size} is not a multiple of num_heads")
        if config.head_dim % 4:
            # Axial RoPE splits each half of a head between the h and w axes.
            raise ConfigError(f"{source}: vision head_dim {config.head_dim} is not a multiple of 4")
        if config.position_grid_side**2 != config.num_position_embeddings:
            raise ConfigError(
                f"{source}: vision_config.num_position_embeddings {config.num_position_embeddings} is not a square grid"
            )
        if config.hidden_act not in BLOCK_ACTIVATIONS:
            raise ConfigError(f"{source}: vision_config.hidden_act {config.hidden_act!r} is not one of {BLOCK_ACTIVATIONS}")
        return config
