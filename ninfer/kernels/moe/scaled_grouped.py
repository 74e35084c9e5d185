"""FP8 x FP8 routed experts for prefill: torch's scaled grouped GEMM (CUTLASS, sm_90) over the
pairs sorted by expert, with per-token activation scales and the experts' per-output-row weight
scales, instead of dequantizing every expert of the layer to bf16 for the bf16 grouped GEMM.

products() computes, for rows sorted by expert (expert e owns rows [ends[e-1], ends[e])):
    gate|up = (q(x) @ W_up[e]^T) * x_scale[row] * up_scale[e, n]       (bf16)
    act     = silu(gate) * up                                           (bf16)
    out     = (q(act) @ W_down[e]^T) * act_scale[row] * down_scale[e, n] (bf16)
where q quantizes each row to e4m3 with its own scale (kernels/fp8_quant: amax / 448). Against
ref.fused_experts (dequantized fp32 weights, unquantized activations) it adds the activations'
e4m3 rounding, as the dense FP8 layers' prefill does (Fp8Linear through torch._scaled_mm).

Whether torch has it is found once per device by a small product compared with a reference,
never inside a graph capture; where it has not, fused_experts keeps the dequantized bf16 route.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.kernels.fp8_quant import quantize_rows
from ninfer.kernels.fp8_quant.ref import FP8
from ninfer.kernels.fp8_quant.ref import quantize_rows as quantize_rows_ref
from ninfer.kernels.route_probe import RouteProbe

# Each product alone, on the same operands: the fast accumulation and the bf16 output's rounding.
PROBE = RouteProbe("torch's scaled grouped GEMM", "FP8 expert prefill keeps the dequantized bf16 route", 1e-2)


def _scaled_grouped_mm():
    return getattr(torch, "_scaled_grouped_mm", None)


def eligible(x: torch.Tensor, gate_up_proj: torch.Tensor, gate_up_scale, down_scale) -> bool:
    """bf16 x on CUDA, e4m3 experts with one fp32 scale per output row ([E, N]), sizes the
    CUTLASS kernel aligns (multiples of 16); whether it works: supported()."""
    _, two_inter, hidden = gate_up_proj.shape
    per_row = all(
        isinstance(scale, torch.Tensor) and scale.dim() == 2 and scale.dtype == torch.float32
        for scale in (gate_up_scale, down_scale)
    )
    return (
        x.is_cuda and x.dtype == torch.bfloat16 and gate_up_proj.dtype == FP8 and per_row
        and hidden % 16 == 0 and two_inter % 32 == 0 and _scaled_grouped_mm() is not None
    )  # fmt: skip


def products(
    x_sorted: torch.Tensor, ends: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    gate_up_scale: torch.Tensor, down_scale: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """x_sorted [P, H] bf16 (rows sorted by expert), ends [E] int32 (one past each expert's last
    row) -> each row's expert output [P, H] bf16 (above)."""
    x_fp8, x_scale = quantize_rows(x_sorted, 1)
    gate_up = _grouped(x_fp8, x_scale, gate_up_proj, gate_up_scale, ends)
    gate, up = gate_up.chunk(2, dim=-1)
    act_fp8, act_scale = quantize_rows(F.silu(gate) * up, 1)
    return _grouped(act_fp8, act_scale, down_proj, down_scale, ends)


def _grouped(a_fp8, a_scale, weight, weight_scale, ends) -> torch.Tensor:
    """One product on torch's op: rows a [P, K] e4m3 (scales [P, 1]) by their expert's [N, K] -> [P, N] bf16."""
    return _scaled_grouped_mm()(a_fp8, weight.transpose(1, 2), a_scale.view(-1), weight_scale, offs=ends,
                                out_dtype=torch.bfloat16, use_fast_accum=True)  # fmt: skip


def _reference_grouped(a_fp8, a_scale, weight, weight_scale, ends) -> torch.Tensor:
    """_grouped in fp32 torch ops, one expert at a time, rounded to bf16 once."""
    out = torch.zeros(a_fp8.shape[0], weight.shape[1], dtype=torch.bfloat16, device=a_fp8.device)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        w = weight[expert].float() * weight_scale[expert, :, None]
        out[start:end] = ((a_fp8[start:end].float() * a_scale[start:end]) @ w.T).bfloat16()
        start = end
    return out


def reference_products(x_sorted, ends, gate_up_proj, down_proj, gate_up_scale, down_scale) -> torch.Tensor:
    """products() in fp32 torch ops, with the same row quantizations and bf16 roundings."""
    x_fp8, x_scale = quantize_rows_ref(x_sorted, 1)
    gate_up = _reference_grouped(x_fp8, x_scale, gate_up_proj, gate_up_scale, ends)
    gate, up = gate_up.chunk(2, dim=-1)
    act_fp8, act_scale = quantize_rows_ref(F.silu(gate) * up, 1)
    return _reference_grouped(act_fp8, act_scale, down_proj, down_scale, ends)


def supported(device: torch.device) -> bool:
    """Whether torch's scaled grouped GEMM computes products() right on `device`: each product of a
    small problem against _reference_grouped on the same operands, once per device (PROBE)."""
    return PROBE.supported(device, "per-row scales", lambda: _probe_problem(device))


def _probe_problem(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(0)
    num_experts, hidden, inter = 4, 256, 128
    ends = torch.tensor([7, 7, 30, 45], dtype=torch.int32, device=device)  # uneven, one expert empty
    x = torch.randn(45, hidden, generator=generator, device=device).bfloat16()
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=generator, device=device) * 64).clamp(-448, 448).to(FP8)
    down = (torch.randn(num_experts, hidden, inter, generator=generator, device=device) * 64).clamp(-448, 448).to(FP8)
    up_scale = torch.rand(num_experts, 2 * inter, generator=generator, device=device) / 512 + 1e-3
    down_scale = torch.rand(num_experts, hidden, generator=generator, device=device) / 512 + 1e-3
    # Each product against the reference on the same e4m3 operands: between them, one activation's
    # rounding flipped by the fast accumulation would move the output by an e4m3 step of its term.
    x_fp8, x_scale = quantize_rows(x, 1)
    first = _grouped(x_fp8, x_scale, gate_up, up_scale, ends)
    gate, up = first.chunk(2, dim=-1)
    act_fp8, act_scale = quantize_rows(F.silu(gate) * up, 1)
    second = _grouped(act_fp8, act_scale, down, down_scale, ends)
    expected = (_reference_grouped(x_fp8, x_scale, gate_up, up_scale, ends),
                _reference_grouped(act_fp8, act_scale, down, down_scale, ends))  # fmt: skip
    scales = [want.float().abs().max().clamp(min=1e-6) for want in expected]
    got = torch.cat([out.float().flatten() / scale for out, scale in zip((first, second), scales)])
    return got, torch.cat([want.float().flatten() / scale for want, scale in zip(expected, scales)])
