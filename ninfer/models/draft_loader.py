"""Build a DFlash / DFlash2 drafter and fill it from its checkpoint's tensors.

Stored names are the module's own (`layers.{i}.self_attn.k_proj.weight`, `fc.weight`,
`candidate_selector.predecessor_codebook`, ...); q/k/v and gate/up parts land in their packed
projections as in the target's loader, which checks that every parameter is written exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ninfer.models.dflash import DflashDraftModel
from ninfer.models.draft_config import DraftConfig
from ninfer.models.family import WeightSlice
from ninfer.models.loader import load_weights
from ninfer.models.meta_build import meta_build, with_storage


def _stored_as_named(name: str, tensor: torch.Tensor, config: DraftConfig) -> Iterator[WeightSlice]:
    yield name, None, tensor


def load_draft_model(
    config: DraftConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    total: int | None = None,
    progress: bool = False,
    source: str = "drafter checkpoint",
) -> DflashDraftModel:
    """WeightLoadError names what is missing, unknown or mis-shaped (device "meta": a dry run)."""
    with meta_build():
        model = DflashDraftModel(config).to(dtype)
    model = with_storage(model, device)
    model.rotary_emb.reset_buffers()
    load_weights(model, tensors, total=total, progress=progress, source=source, rule=_stored_as_named)
    return model.eval()
