"""CheckpointScales: a quantized checkpoint's scales, held until the weight they scale arrives.

An artifact yields each quantized weight right after its scales, so each weight takes the
scales pending for it, sliced by the checkpoint rule exactly as the weight is: every write
then carries the scales of its own rows (StoredWrite).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ninfer.models.config import ModelConfig
from ninfer.models.family import CheckpointRule
from ninfer.models.quant.fp8 import FP8, expand_block_rows
from ninfer.models.quant.stored_write import StoredWrite
from ninfer.models.weight_load_error import WeightLoadError

FP8_SCALE_SUFFIX = "_scale_inv"  # Qwen FP8 checkpoints: "<weight name>_scale_inv" holds its block scales
# ModelOpt NVFP4 checkpoints: "<weight name>_scale" (e4m3 per 16 values) and "<weight name>_scale_2"
# (the tensor's fp32 global scale) accompany each uint8 weight of packed e2m1 codes.
NVFP4_BLOCK_SUFFIX = "_scale"
NVFP4_GLOBAL_SUFFIX = "_scale_2"


class CheckpointScales:
    def __init__(self, source: str):
        self.source = source
        self._fp8: dict[str, torch.Tensor] = {}  # weight name -> its block scales
        self._nvfp4: dict[str, dict[str, torch.Tensor]] = {}  # weight name -> suffix -> scales

    def hold(self, stored_name: str, tensor: torch.Tensor) -> bool:
        """Keep `tensor` for its weight if it is a weight's scales; whether it was."""
        if stored_name.endswith(FP8_SCALE_SUFFIX):
            self._fp8[stored_name.removesuffix(FP8_SCALE_SUFFIX)] = tensor
            return True
        suffix = _nvfp4_scale_suffix(stored_name)
        if suffix is None:
            return False
        self._nvfp4.setdefault(stored_name.removesuffix(suffix), {})[suffix] = tensor
        return True

    def writes(
        self, stored_name: str, tensor: torch.Tensor, rule: CheckpointRule, config: ModelConfig
    ) -> Iterator[StoredWrite]:
        """The rule's writes of a stored tensor, each with its rows' share of the tensor's scales."""
        fp8_scales: list[torch.Tensor] | None = None
        nvfp4_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if tensor.dtype == torch.uint8 and stored_name in self._nvfp4:
            block_scale, row_scale = self._nvfp4_scales(stored_name, tensor)
            nvfp4_scales = list(zip(_sliced(rule, stored_name, block_scale, config),
                                    _sliced(rule, stored_name, row_scale, config)))
        elif tensor.dtype == FP8:
            block_scale = self._fp8.pop(stored_name, None)
            if block_scale is None:
                raise WeightLoadError(
                    f"{self.source}: FP8 tensor {stored_name!r} has no {FP8_SCALE_SUFFIX} scales before it"
                )
            fp8_scales = _sliced(rule, stored_name, expand_block_rows(block_scale, tensor.shape[-2]), config)
        what = f"{self.source}: tensor {stored_name!r}"
        for write, (param_name, index, value) in enumerate(rule(stored_name, tensor, config)):
            yield StoredWrite(
                what,
                param_name,
                index,
                value,
                None if fp8_scales is None else fp8_scales[write],
                None if nvfp4_scales is None else nvfp4_scales[write],
            )

    def _nvfp4_scales(self, stored_name: str, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An NVFP4 weight's block scales and, per row, its global scale (packed parts each keep their own)."""
        scales = self._nvfp4.pop(stored_name)
        if NVFP4_BLOCK_SUFFIX not in scales or NVFP4_GLOBAL_SUFFIX not in scales:
            missing = NVFP4_BLOCK_SUFFIX if NVFP4_BLOCK_SUFFIX not in scales else NVFP4_GLOBAL_SUFFIX
            raise WeightLoadError(f"{self.source}: NVFP4 weight {stored_name!r} has no {stored_name}{missing} before it")
        block_scale = scales[NVFP4_BLOCK_SUFFIX]
        expected = [*codes.shape[:-1], codes.shape[-1] * 2 // 16]
        if block_scale.shape != tuple(expected):
            raise WeightLoadError(
                f"{self.source}: NVFP4 weight {stored_name!r} {list(codes.shape)} has block scales "
                f"{list(block_scale.shape)}; expected {expected}"
            )
        row_scale = scales[NVFP4_GLOBAL_SUFFIX].float().reshape(-1)[:1].expand(codes.shape[:-1]).unsqueeze(-1)
        return block_scale, row_scale


def _sliced(rule: CheckpointRule, stored_name: str, scales: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
    """Scales laid out by the weight's rows, sliced into the rule's writes as the weight is."""
    return [value for _, _, value in rule(stored_name, scales, config)]


def _nvfp4_scale_suffix(stored_name: str) -> str | None:
    for suffix in (NVFP4_GLOBAL_SUFFIX, NVFP4_BLOCK_SUFFIX):
        if stored_name.endswith(".weight" + suffix):
            return suffix
    return None
