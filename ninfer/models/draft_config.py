"""DraftConfig: a DFlash / DFlash2 drafter's architecture, parsed once from its config.json.

The drafters are Qwen3-style checkpoints (model_type "qwen3", architectures DFlashDraftModel or
DFlash2DraftModel) with their own facts under `dflash_config`: the block size, the mask token,
which target layers feed the context, and DFlash2's convolution and selector sizes.

Attention causality per layer follows the published readers: an explicit top-level `is_causal`
wins, then `dflash_config.causal`, else a layer is causal exactly when it is a sliding-window
layer. A sliding layer's window is `dflash_config.swa_window_size`, else `sliding_window`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ninfer.models.config import ConfigError

DFLASH = "dflash"
DFLASH2 = "dflash2"
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
# dflash_config fields only DFlash2 drafters have.
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True)
class DraftConfig:
    kind: str  # DFLASH or DFLASH2
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool
    block_size: int  # rows the drafter was trained to fill at once: the last token, then masks
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # the target layers whose residual streams form the context
    layer_causal: tuple[bool, ...]
    layer_windows: tuple[int | None, ...]  # each layer's sliding window (None: full attention)
    logit_scale: float = 1.0  # dflash_config.output_multiplier
    logit_softcap: float | None = None  # dflash_config.final_logit_softcapping
    input_embedding_scale: float = 1.0
    conv_kernel_size: int = 0  # DFlash2: taps of each grouped dynamic convolution
    conv_group_size: int = 0  # DFlash2: channels sharing one dynamic tap
    selector_rank: int = 0  # DFlash2: codebook rank of the candidate selector
    selector_top_k: int = 0  # DFlash2: candidates the selector walks per position

    # The drafter's RoPE is plain 1-D: what RotaryEmbedding reads besides the fields above.
    mrope_section = None
    mrope_interleaved = False

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_dflash2(self) -> bool:
        return self.kind == DFLASH2

    @classmethod
    def from_hf(cls, hf: dict[str, Any], kind: str, source: str = "config.json") -> DraftConfig:
        """Parse a drafter's config.json for --spec `kind`; ConfigError names the missing or wrong field."""
        draft = hf.get("dflash_config")
        if not isinstance(draft, dict):
            raise ConfigError(f"{source}: no dflash_config object (not a DFlash drafter)")

        def need(table: dict[str, Any], key: str, where: str = "") -> Any:
            if table.get(key) is None:
                raise ConfigError(f"{source}: missing required field {where}{key}")
            return table[key]

        present = [f for f in DFLASH2_FIELDS if draft.get(f) is not None]
        if kind == DFLASH and present:
            raise ConfigError(f"{source}: a DFlash2 drafter (dflash_config.{present[0]}); serve it with --spec dflash2")
        if kind == DFLASH2 and len(present) < len(DFLASH2_FIELDS):
            missing = ", ".join(f"dflash_config.{f}" for f in DFLASH2_FIELDS if f not in present)
            raise ConfigError(f"{source}: DFlash2 fields missing: {missing}")

        hidden = int(need(hf, "hidden_size"))
        num_heads = int(need(hf, "num_attention_heads"))
        num_layers = int(need(hf, "num_hidden_layers"))
        layer_types = list(hf.get("layer_types") or [FULL_ATTENTION] * num_layers)
        if len(layer_types) != num_layers:
            raise ConfigError(f"{source}: layer_types has {len(layer_types)} entries for {num_layers} layers")
        unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise ConfigError(f"{source}: unsupported layer types {unknown}")
        window = draft.get("swa_window_size", hf.get("sliding_window"))
        if SLIDING_ATTENTION in layer_types and not window:
            raise ConfigError(
                f"{source}: sliding_attention layers need sliding_window (or dflash_config.swa_window_size)"
            )
        causal = hf.get("is_causal", draft.get("causal"))
        layer_ids = need(draft, "target_layer_ids", "dflash_config.")
        if not isinstance(layer_ids, list) or not layer_ids:
            raise ConfigError(f"{source}: dflash_config.target_layer_ids must be a non-empty list")

        rope = dict(hf.get("rope_parameters") or {})
        if isinstance(hf.get("rope_scaling"), dict):
            rope = {**hf["rope_scaling"], **rope}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type not in (None, "default"):
            scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
        softcap = draft.get("final_logit_softcapping")
        return cls(
            kind=kind,
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            intermediate_size=int(need(hf, "intermediate_size")),
            vocab_size=int(need(hf, "vocab_size")),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 1_000_000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
            rope_scaling=scaling,
            attention_bias=bool(hf.get("attention_bias") or False),
            block_size=int(need(draft, "block_size", "dflash_config.")),
            mask_token_id=int(need(draft, "mask_token_id", "dflash_config.")),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            layer_causal=tuple(
                bool(causal) if causal is not None else layer_type == SLIDING_ATTENTION for layer_type in layer_types
            ),
            layer_windows=tuple(int(window) if t == SLIDING_ATTENTION else None for t in layer_types),
            logit_scale=float(draft.get("output_multiplier", 1.0)),
            logit_softcap=float(softcap) if softcap else None,
            input_embedding_scale=float(draft.get("input_embedding_scale", 1.0)),
            **{f: int(draft[f]) for f in present},
        )
