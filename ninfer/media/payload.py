"""PreparedMedia: the immutable BF16 patch input of one image or video, shared across requests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.media.source import Modality


@dataclass(frozen=True, eq=False)
class PreparedMedia:
    modality: Modality
    sha256: str  # hex digest of the acquired bytes; with the modality, the cache key
    grid_thw: tuple[int, int, int]  # temporal groups, patch rows, patch columns (before the 2×2 merge)
    patches: torch.Tensor  # BF16 [grid t·h·w, 1536]; shared, so never written to
    timestamps_s: tuple[float, ...] | None  # seconds per temporal group; None for images

    @property
    def key(self) -> tuple[Modality, str]:
        return (self.modality, self.sha256)

    @property
    def patch_rows(self) -> int:
        return self.patches.shape[0]

    @property
    def nbytes(self) -> int:
        return self.patches.numel() * self.patches.element_size()

    def vision_tokens(self, patches_per_token: int = 4) -> int:
        """Tokens the LLM sees after the tower merges each merge group into one."""
        return self.patch_rows // patches_per_token
