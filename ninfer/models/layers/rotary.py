"""RotaryEmbedding: cos/sin tables for positions (1-D RoPE, llama3/linear scaling, interleaved MRoPE)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ninfer.models.config import ConfigError, ModelConfig


def _inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ConfigError(f"unsupported rope scaling type {rope_type!r}")


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.mrope_section = config.mrope_section if config.mrope_interleaved else None
        if torch.empty(0).is_meta:
            # Built on the meta device: the table is computed by reset_buffers once materialised
            # (computing it on meta runs torch's Python references, which import its compiler).
            inv_freq = torch.empty(config.rotary_dim // 2)
        else:
            inv_freq = _inverse_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the table after the model was built on the meta device."""
        self.inv_freq = _inverse_frequencies(self.config).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] or [3, T] (t, h, w) -> cos, sin: [T, rotary_dim] in dtype (computed in fp32)."""
        inv_freq = self.inv_freq.float()
        if positions.dim() == 1:
            freqs = positions.float()[:, None] * inv_freq[None, :]
        else:
            axis_freqs = positions.float()[:, :, None] * inv_freq[None, None, :]  # [3, T, F]
            freqs = axis_freqs[0].clone() if self.mrope_section else axis_freqs[0]
            if self.mrope_section:
                # interleaved MRoPE: frequency j takes H when j % 3 == 1, W when j % 3 == 2 (within the sections)
                for axis, offset in ((1, 1), (2, 2)):
                    idx = slice(offset, self.mrope_section[axis] * 3, 3)
                    freqs[:, idx] = axis_freqs[axis, :, idx]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)
