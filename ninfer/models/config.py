"""ModelConfig: the architecture facts every model file needs, parsed once from an HF config.

One flat dataclass for all families keeps the model files free of HF config quirks
(nested text_config, rope_parameters vs rope_theta, layer_types vs interval). from_hf parses
what every family has; each family's config_fields (models/families/) parses what its
architecture adds (Gated DeltaNet layers, routed experts, an MTP head) and its quirks. The
defaults describe a model without those parts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

class ConfigError(ValueError):
    """The artifact's config cannot describe a model we can build."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # HF model_type of the text trunk (e.g. "qwen3_5_text", "qwen2")
    family: str  # our model file: "qwen3_5", "qwen3_next", "llama"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    torch_dtype: str = "bfloat16"

    # rotary
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    rope_scaling: dict[str, Any] | None = None  # llama3 / linear / yarn parameters, if any
    mrope_section: tuple[int, ...] | None = None  # Qwen3.5+: interleaved T/H/W sections
    mrope_interleaved: bool = False

    # attention flavour
    attention_bias: bool = False  # q/k/v biases (always for Qwen2)
    attention_output_bias: bool = False  # Llama's attention_bias also covers o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3, Qwen3-MoE, Qwen3.5, Qwen3-Next
    attn_output_gate: bool = False  # Qwen3.5 / Qwen3-Next: sigmoid gate interleaved in q_proj
    zero_centered_norm: bool = False  # (1 + w) RMSNorm: Qwen3.5 / Qwen3-Next

    # layer layout; Gated DeltaNet layers' shapes (hybrid families)
    layer_types: tuple[str, ...] = ()
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32

    # mixture of experts (num_experts == 0 means dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    # multi-token prediction head (weights in mtp.*)
    mtp_num_hidden_layers: int = 0

    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- derived facts -------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def layer_is_moe(self, layer_id: int) -> bool:
        if not self.is_moe or layer_id in self.mlp_only_layers:
            return False
        return (layer_id + 1) % max(self.decoder_sparse_step, 1) == 0

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- parsing -------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Parse an HF config dict (composite VLM configs use their text_config)."""
        top = hf
        model_type = hf.get("model_type")
        text = hf.get("text_config")
        if isinstance(text, dict):
            hf = {**text}
            model_type = hf.get("model_type") or f"{model_type}_text"
            for key in ("tie_word_embeddings",):
                if key in top and key not in hf:
                    hf[key] = top[key]
        if model_type is None:
            raise ConfigError(f"{source}: no model_type")
        from ninfer.models.registry import family_for_model_type, supported_model_types

        base_type = model_type.removesuffix("_text")
        family = family_for_model_type(model_type)
        if family is None:
            raise ConfigError(
                f"{source}: unsupported model_type {model_type!r} (supported: {', '.join(supported_model_types())})"
            )

        def need(key: str) -> Any:
            if key not in hf or hf[key] is None:
                raise ConfigError(f"{source}: missing required key {key!r} for {model_type}")
            return hf[key]

        hidden = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        num_layers = int(need("num_hidden_layers"))
        head_dim = hf.get("head_dim") or hidden // num_heads
        rope = dict(hf.get("rope_parameters") or {})
        legacy_scaling = hf.get("rope_scaling")
        if isinstance(legacy_scaling, dict):
            rope = {**legacy_scaling, **rope}
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type not in (None, "default", "mrope"):
            scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}

        hybrid = family.hybrid
        layer_types = hf.get("layer_types")
        if hybrid and not layer_types:
            interval = int(hf.get("full_attention_interval", 4))
            layer_types = [
                LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)
            ]
        if not layer_types:
            layer_types = [FULL_ATTENTION] * num_layers
        if len(layer_types) != num_layers:
            raise ConfigError(f"{source}: layer_types has {len(layer_types)} entries for {num_layers} layers")
        bad = set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}
        if bad:
            raise ConfigError(f"{source}: unsupported layer types {sorted(bad)}")

        eos = hf.get("eos_token_id", top.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        try:
            family_fields = family.config_fields(hf, rope, base_type)
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None
        intermediate = hf.get("intermediate_size")
        if intermediate is None and not family_fields.get("num_experts"):
            raise ConfigError(f"{source}: missing required key 'intermediate_size' for {model_type}")
        dtype = hf.get("dtype") or hf.get("torch_dtype") or top.get("dtype") or top.get("torch_dtype") or "bfloat16"

        fields = dict(
            model_type=model_type,
            family=family.name,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            intermediate_size=int(intermediate or 0),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            hidden_act=str(hf.get("hidden_act", "silu")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            torch_dtype=str(dtype).removeprefix("torch."),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            rope_scaling=scaling,
            attention_bias=bool(hf.get("attention_bias") or False),
            mlp_bias=bool(hf.get("mlp_bias") or False),
            layer_types=tuple(layer_types),
            bos_token_id=hf.get("bos_token_id", top.get("bos_token_id")),
            eos_token_id=eos_ids,
            pad_token_id=hf.get("pad_token_id", top.get("pad_token_id")),
            extra={"top_level": {k: v for k, v in top.items() if k != "text_config"}},
        )
        return cls(**{**fields, **family_fields})
