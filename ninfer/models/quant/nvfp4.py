"""NVFP4 weights on GPUs without FP4 tensor cores: 4.5 bits a weight, widened where they are used.

A weight is e2m1 codes, an e4m3 scale per 16 values and an fp32 scale per row
(kernels/nvfp4_gemv/ref.py has the layout). Decode streams a quarter of the bf16 bytes
through the weight-only GEMV, which widens codes in registers. Larger batches (prefill)
run the NVFP4 GEMM (kernels/nvfp4_gemm), which dequantizes weight tiles in registers for
the tensor cores on CUDA; on the CPU its reference dequantizes the weight and runs one
fp32 matmul.
Embeddings, lm_head and MoE routers stay bf16, as in ModelOpt's NVFP4 checkpoints; fused MoE
experts become Nvfp4Experts (nvfp4_experts.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer.kernels.nvfp4_gemv.ref import MAX_ROWS
from ninfer.kernels.nvfp4_gemm import nvfp4_matmul
from ninfer.kernels.nvfp4_gemv import BLOCK, dequantize_nvfp4, gemv_nvfp4, quantize_nvfp4
from ninfer.models.layers.moe import Experts
from ninfer.models.quant.linear_replacement import UnfusedEpilogues, replace_linear_layers, replace_modules
from ninfer.models.quant.nvfp4_experts import Nvfp4Experts
from ninfer.models.quant.row_chunks import quantize_rows_into
from ninfer.models.quant.stored_write import StoredWrite

DEFAULT_SKIP = ("lm_head", "embed_tokens", "mlp.gate")


class Nvfp4Linear(UnfusedEpilogues, nn.Module):
    stored_weights = ("weight",)  # StoresCheckpointWrites

    def __init__(
        self,
        weight: torch.Tensor,
        block_scale: torch.Tensor,
        row_scale: torch.Tensor,
        bias: torch.Tensor | None,
        parts: dict[str, int] | None = None,
    ):
        """weight uint8 [out, in/2], block_scale e4m3 [out, in/16], row_scale fp32 [out];
        parts: a PackedLinear's (each part keeps its checkpoint's global scale in its rows)."""
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("block_scale", block_scale)
        self.register_buffer("row_scale", row_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.parts = parts

    @classmethod
    def placeholder(cls, linear: nn.Linear) -> Nvfp4Linear:
        """An unfilled module shaped like `linear` (on its device, e.g. meta), for a loader to fill."""
        device = linear.weight.device
        out_features, in_features = linear.weight.shape
        if in_features % BLOCK:
            raise ValueError(f"NVFP4 needs a multiple of {BLOCK} input features, not {in_features}")
        return cls(
            torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device),
            torch.empty(out_features, in_features // BLOCK, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(out_features, dtype=torch.float32, device=device),
            None if linear.bias is None else linear.bias.detach(),
            getattr(linear, "parts", None),
        )

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> Nvfp4Linear:
        """Quantized a chunk of rows at a time (row_chunks.py): at once, quantize_nvfp4's
        temporaries would be ~180 bytes per weight."""
        placeholder = cls.placeholder(linear)
        placeholder.quantize_into(None, linear.weight.detach())
        return placeholder

    def quantize_into(self, index, value: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Quantize bf16 weight rows into this module: value is the weight's rows at `index`
        (None: all), rounded to dtype first when given (as an unquantized load would hold it)."""
        targets = (self.weight, self.block_scale, self.row_scale)
        quantize_rows_into(value, targets if index is None else [t[index] for t in targets], quantize_nvfp4, dtype)

    def load_stored(self, attribute: str, write: StoredWrite, dtype: torch.dtype | None = None) -> None:
        """A checkpoint's write into the weight: NVFP4 codes with their scales as stored (the
        tensor's global scale as its rows' scale), anything else dequantized and quantized."""
        if write.nvfp4_scales is None:
            codes = write.target(self.weight).shape
            self.quantize_into(write.index, write.dense((*codes[:-1], codes[-1] * 2)), dtype)  # two codes a byte
            return
        block_scale, row_scale = write.nvfp4_scales
        write.copy_into(self.weight)
        write.target(self.block_scale).copy_(block_scale)
        write.target(self.row_scale).copy_(row_scale.reshape(-1))

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] * 2

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_nvfp4(self.weight, self.block_scale, self.row_scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        product = gemv_nvfp4 if rows.shape[0] <= MAX_ROWS else nvfp4_matmul
        out = product(rows, self.weight, self.block_scale, self.row_scale, self.bias)
        return out.reshape(*shape[:-1], self.out_features)


def quantize_nvfp4_(model: nn.Module, skip: tuple[str, ...] = DEFAULT_SKIP, placeholders: bool = False) -> int:
    """Replace every nn.Linear whose input features are a multiple of 16 by an Nvfp4Linear and
    every fused Experts by an Nvfp4Experts in place, except those named by `skip` (whole dotted
    components), Linear layers with fewer than 16 outputs, and experts whose projections' input
    features are not a multiple of 16; returns how many.
    placeholders: unfilled modules instead, on a meta-device model, for the loader to quantize
    each bf16 weight into as it arrives (loader.build_model)."""
    linears = replace_linear_layers(
        model,
        skip,
        Nvfp4Linear.placeholder if placeholders else Nvfp4Linear.from_linear,
        lambda linear: linear.out_features >= 16 and linear.in_features % BLOCK == 0,
    )
    return linears + replace_modules(
        model,
        Experts,
        skip,
        Nvfp4Experts.placeholder if placeholders else Nvfp4Experts.from_experts,
        lambda experts: all(getattr(experts, name).shape[-1] % BLOCK == 0 for name in ("gate_up_proj", "down_proj")),
    )
