"""FP8 x FP8 routed experts for prefill (kernels/moe/scaled_grouped.py).

On the CPU, torch._scaled_grouped_mm is replaced by an emulation of its 2-D x 3-D rowwise form
as torch documents it (A [M, K] e4m3 with one scale per row, B [G, K, N] with one scale per
group and column, groups of A's rows ending at offs), which checks the operands products()
builds and the probe's outcomes; on the GPU (marked gpu) the real product inside fused_experts
against ref.fused_experts at the 35B-A3B's expert shapes.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.fp8_quant.ref import FP8
from ninfer.kernels.moe import ref, scaled_grouped


def _emulated(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
    assert a.dtype == FP8 and b.dtype == FP8 and a.dim() == 2 and b.dim() == 3
    assert b.stride(1) == 1  # [G, K, N] seen from row-major [G, N, K]
    assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2]) and offs.dtype == torch.int32
    out = torch.zeros(a.shape[0], b.shape[2])
    start = 0
    for group, end in enumerate(offs.tolist()):
        out[start:end] = (a[start:end].float() @ b[group].float()) * scale_a[start:end, None] * scale_b[group][None, :]
        start = end
    return out.to(out_dtype)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(scaled_grouped.torch, "_scaled_grouped_mm", _emulated, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(scaled_grouped.PROBE, "known", {})


def _experts(num_experts: int, hidden: int, inter: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 64).clamp(-448, 448).to(FP8)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) * 64).clamp(-448, 448).to(FP8)
    up_scale = torch.rand(num_experts, 2 * inter, generator=gen) / 512 + 1e-3
    down_scale = torch.rand(num_experts, hidden, generator=gen) / 512 + 1e-3
    return gate_up, down, up_scale, down_scale


def test_products_against_the_reference_and_the_dequantized_experts(emulated) -> None:
    gate_up, down, up_scale, down_scale = _experts(4, 64, 32, seed=1)
    ends = torch.tensor([5, 5, 17, 23], dtype=torch.int32)
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = scaled_grouped.products(x, ends, gate_up, down, up_scale, down_scale).float()
    want = scaled_grouped.reference_products(x, ends, gate_up, down, up_scale, down_scale).float()
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    # Against the experts in fp32 (ref.fused_experts' products, one expert per row, weight 1):
    # only the activations' e4m3 rounding apart, a few percent of the largest output.
    start = 0
    for expert, end in enumerate(ends.tolist()):
        rows = x[start:end]
        ids = torch.full((end - start, 1), expert)
        exact = ref.fused_experts(rows.float(), torch.ones(end - start, 1), ids, gate_up, down, up_scale, down_scale)
        if end > start:
            assert (got[start:end] - exact).abs().max() <= 0.1 * exact.abs().max()
        start = end


def test_eligible_layouts() -> None:
    gate_up, down, up_scale, down_scale = _experts(4, 64, 32, seed=1)
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert not scaled_grouped.eligible(x, gate_up, up_scale, down_scale)  # on the CPU: never
    cuda_like = type("CudaLike", (), {"is_cuda": True, "dtype": torch.bfloat16})()
    has_op = scaled_grouped._scaled_grouped_mm() is not None
    assert scaled_grouped.eligible(cuda_like, gate_up, up_scale, down_scale) == has_op
    blocks = torch.ones(4, 1, 1)  # 128 x 128 block scales: the dequantized route
    assert not scaled_grouped.eligible(cuda_like, gate_up, blocks, blocks)
    assert not scaled_grouped.eligible(cuda_like, gate_up.bfloat16(), None, None)


def test_probe_decides_once_and_never_while_capturing(emulated, monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cpu", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not scaled_grouped.supported(device) and scaled_grouped.PROBE.known == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert scaled_grouped.supported(device) and scaled_grouped.PROBE.known == {(0, "per-row scales"): True}


def test_probe_rejects_a_missing_or_wrong_product(emulated, monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cpu", 0)

    def missing(*args, **kwargs):
        raise RuntimeError("scaled grouped GEMM needs sm_90")

    monkeypatch.setattr(scaled_grouped.torch, "_scaled_grouped_mm", missing, raising=False)
    assert scaled_grouped.PROBE._check(lambda: scaled_grouped._probe_problem(device)) is False

    def groups_shifted(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
        shifted = b.transpose(1, 2).roll(1, dims=0).transpose(1, 2)  # each group reads the wrong expert
        return _emulated(a, shifted, scale_a, scale_b.roll(1, dims=0), offs, out_dtype)

    monkeypatch.setattr(scaled_grouped.torch, "_scaled_grouped_mm", groups_shifted, raising=False)
    assert scaled_grouped.PROBE._check(lambda: scaled_grouped._probe_problem(device)) is False


def test_probe_accepts_an_accumulation_that_flips_the_activations_rounding(emulated, monkeypatch) -> None:
    # A product off by 2^-9 of each output (a fast accumulation's order) passes: the probe checks
    # each product on the same operands, so a rounding of the activation it flips is not an error.
    device = torch.device("cpu", 0)

    def noisy(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
        exact = _emulated(a, b, scale_a, scale_b, offs, torch.float32)
        signs = torch.where(torch.arange(exact.numel()).view(exact.shape) % 2 == 0, 1.0, -1.0)
        return (exact * (1 + signs * 2**-9)).to(out_dtype)

    monkeypatch.setattr(scaled_grouped.torch, "_scaled_grouped_mm", noisy, raising=False)
    got, expected = scaled_grouped._probe_problem(device)
    assert not torch.equal(got, expected)
    assert scaled_grouped.PROBE._check(lambda: (got, expected)) is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [4096, 8192])
def test_fused_experts_on_fp8_operands_at_35b_shapes(num_tokens: int) -> None:
    from ninfer.kernels.moe import triton as moe_fast

    num_experts, hidden, inter, top_k = 256, 2048, 512, 8
    gen = torch.Generator("cuda").manual_seed(num_tokens)
    weights_bf16 = [torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden**-0.5,
                    torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) * inter**-0.5]
    quantized = []
    for w in weights_bf16:
        scale = (w.abs().amax(dim=-1) / 448.0).clamp(min=1e-12)
        quantized.append(((w / scale[..., None]).clamp(-448, 448).to(FP8), scale))
    (gate_up, up_scale), (down, down_scale) = quantized
    if not (moe_fast.scaled_grouped.eligible(torch.empty(1, hidden, device="cuda", dtype=torch.bfloat16), gate_up, up_scale, down_scale)
            and moe_fast.scaled_grouped.supported(gate_up.device)):
        pytest.skip("this torch has no scaled grouped GEMM")
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    route_weights, ids = moe_fast.route(torch.randn(num_tokens, num_experts, device="cuda", generator=gen), top_k, True)
    got = moe_fast.fused_experts(x, route_weights, ids, gate_up, down, up_scale, down_scale, grouped_mm=True, fp8_grouped=True)
    dequantized = moe_fast.fused_experts(x, route_weights, ids, gate_up, down, up_scale, down_scale, grouped_mm=True, fp8_grouped=False)
    want = ref.fused_experts(x[:512], route_weights[:512], ids[:512], gate_up, down, up_scale, down_scale).float()
    # The activations' e4m3 rounding (at most 2^-4 of each value, random in sign) against exact
    # activations: RMS error under 2^-4 of the outputs' RMS, and the dequantized route's likewise.
    for out in (got, dequantized):
        error = out[:512].float() - want
        assert error.pow(2).mean().sqrt() <= 2**-4 * want.pow(2).mean().sqrt()
