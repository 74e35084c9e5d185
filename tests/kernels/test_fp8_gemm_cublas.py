"""Block-scaled FP8 GEMM through cuBLAS (kernels/fp8_gemm/cublas.py).

On the CPU, torch's scaled_mm is replaced by an emulation of its blockwise recipes as torch
documents them (1 x 128 scales [M, K/128] and [N, K/128], column-major; 128 x 128 weight scales
transposed, [K/128, N/128]), which checks the operands this module builds: row padding, scale
layouts and K-block padding, both weight scale layouts, the probe's outcomes. On the GPU
(marked gpu) the real product against the reference at the 27B prefill shapes, and the route
fp8_linear takes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer.kernels.fp8_gemm import cublas, ref
from ninfer.kernels.fp8_quant.ref import FP8
from ninfer.kernels.gemv.ref import SCALE_BLOCK

ONE, BLOCK = "1x128", "128x128"


def _emulated_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):
    """What cuBLAS's blockwise product computes, with the layout checks it makes."""
    rows, cols = a.shape
    out_features = b.shape[1]
    assert a.dtype == FP8 and b.dtype == FP8 and b.shape[0] == cols and b.stride(0) == 1  # b column-major
    assert rows % cublas.ROW_MULTIPLE == 0 and cols % SCALE_BLOCK == 0
    groups = cols // SCALE_BLOCK
    assert recipe_a == ONE and tuple(scale_a.shape) == (rows, groups) and scale_a.stride(0) == 1
    if recipe_b == ONE:
        assert tuple(scale_b.shape) == (out_features, groups) and scale_b.stride(0) == 1
        w_scale = scale_b
    else:
        assert recipe_b == BLOCK and scale_b.shape[0] % 4 == 0 and scale_b.shape[0] >= groups
        assert scale_b.shape[1] == out_features // SCALE_BLOCK
        w_scale = scale_b[:groups].t().repeat_interleave(SCALE_BLOCK, dim=0)
    out = torch.zeros(rows, out_features)
    for group in range(groups):
        cols_of_group = slice(group * SCALE_BLOCK, (group + 1) * SCALE_BLOCK)
        partial = a[:, cols_of_group].float() @ b[cols_of_group].float()
        out += partial * scale_a[:, group, None] * w_scale[None, :, group]
    return out.to(output_dtype)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cublas, "_recipes", lambda: (ONE, BLOCK))
    monkeypatch.setattr(cublas.F, "scaled_mm", _emulated_scaled_mm, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(cublas.PROBE, "known", {})


def _operands(rows: int, out_features: int, cols: int, rows_per_scale: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen).bfloat16()
    weight = (torch.randn(out_features, cols, generator=gen) * 100).clamp(-448, 448).to(FP8)
    scale_rows = out_features if rows_per_scale == 1 else out_features // SCALE_BLOCK
    weight_scale = torch.rand(scale_rows, cols // SCALE_BLOCK, generator=gen) + 0.25
    x_fp8, x_scale = ref.quantize_groups(x)
    return x_fp8, x_scale, weight, weight_scale


@pytest.mark.parametrize("rows_per_scale", [1, SCALE_BLOCK])
@pytest.mark.parametrize("rows", [37, 48])  # padded to 48; already whole
def test_operands_give_the_reference_product(emulated, rows_per_scale: int, rows: int) -> None:
    # 640 columns: 5 K blocks, padded to 8 in the transposed 128 x 128 scales.
    x_fp8, x_scale, weight, weight_scale = _operands(rows, 256, 640, rows_per_scale, seed=rows)
    bias = torch.randn(256, generator=torch.Generator().manual_seed(1))
    want = ref.block_fp8_matmul(x_fp8, x_scale, weight, weight_scale, torch.float32, bias)
    for scale in (x_scale, x_scale.t().contiguous().t()):  # row-major, and quantize_groups' column-major
        got = cublas.matmul(x_fp8, scale, weight, weight_scale, torch.float32, bias)
        assert got.shape == (rows, 256)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_eligible_shapes() -> None:
    x_fp8, _, weight, row_blocks = _operands(16, 256, 512, 1, seed=0)
    blocks = row_blocks[::SCALE_BLOCK].contiguous()
    assert not cublas.eligible(x_fp8, weight, row_blocks)  # on the CPU: never
    cuda_like = type("CudaLike", (), {"is_cuda": True, "shape": x_fp8.shape})()
    recipes = cublas._recipes() is not None
    assert cublas.eligible(cuda_like, weight, row_blocks) == recipes
    assert cublas.eligible(cuda_like, weight, blocks) == recipes
    # A partial last 128-row block, K not a multiple of 128, N not a multiple of 16.
    odd_rows = weight[:208]
    assert not cublas.eligible(cuda_like, odd_rows, torch.ones(2, 4))
    assert cublas.eligible(cuda_like, odd_rows, torch.ones(208, 4)) == recipes
    short_k = type("CudaLike", (), {"is_cuda": True, "shape": (16, 500)})()
    assert not cublas.eligible(short_k, weight[:, :500], torch.ones(256, 4))
    assert not cublas.eligible(cuda_like, weight[:250], torch.ones(250, 4))


def test_probe_decides_once_per_layout_and_never_while_capturing(emulated, monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cpu", 0)
    _, _, weight, row_blocks = _operands(16, 256, 512, 1, seed=0)
    blocks = row_blocks[::SCALE_BLOCK].contiguous()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not cublas.supported(device, weight, row_blocks) and cublas.PROBE.known == {}  # not decided
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert cublas.supported(device, weight, row_blocks) and cublas.PROBE.known == {(0, 1): True}
    assert cublas.supported(device, weight, blocks) and cublas.PROBE.known[(0, SCALE_BLOCK)] is True


def test_probe_rejects_a_missing_or_wrong_product(emulated, monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cpu", 0)

    def missing(*args, **kwargs):
        raise RuntimeError("blockwise scaling needs cuBLAS 12.9")

    monkeypatch.setattr(cublas.F, "scaled_mm", missing, raising=False)
    assert cublas.PROBE._check(lambda: cublas._probe_problem(device, 1)) is False

    def transposed_scales(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):
        # the 128 x 128 scales read as [N/128, K/128]: a layout mistake
        return _emulated_scaled_mm(a, b, scale_a, recipe_a, scale_b.flip(0), recipe_b, output_dtype)

    monkeypatch.setattr(cublas.F, "scaled_mm", transposed_scales, raising=False)
    assert cublas.PROBE._check(lambda: cublas._probe_problem(device, SCALE_BLOCK)) is False
    monkeypatch.setattr(cublas.F, "scaled_mm", _emulated_scaled_mm, raising=False)
    assert cublas.PROBE._check(lambda: cublas._probe_problem(device, SCALE_BLOCK)) is True


# ---- GPU ------------------------------------------------------------------------------------

PROJECTIONS_27B = {"mlp_gate_up": (34816, 5120), "mlp_down": (5120, 17408), "gdn_out_proj": (5120, 6144)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestOnGpu:
    def test_supported_on_hopper(self) -> None:
        """torch 2.11 with CUDA 13 has the blockwise recipes on sm_90: the route must be taken there."""
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("blockwise FP8 scaling in cuBLAS is for sm_90")
        weight = torch.zeros(256, 512, device="cuda", dtype=FP8)
        for scale in (torch.ones(256, 4, device="cuda"), torch.ones(2, 4, device="cuda")):
            assert cublas._recipes() is not None and cublas.supported(weight.device, weight, scale)

    @pytest.mark.parametrize("name", list(PROJECTIONS_27B))
    @pytest.mark.parametrize(("m", "rows_per_scale"), [(1024, 1), (8192, 1), (300, SCALE_BLOCK), (33, 1)])
    def test_real_shapes_against_the_reference_and_the_triton_kernel(self, name: str, m: int, rows_per_scale: int) -> None:
        from ninfer.kernels.fp8_gemm import triton as fast

        n, k = PROJECTIONS_27B[name]
        gen = torch.Generator("cuda").manual_seed(m)
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        weight = (torch.randn(n, k, device="cuda", generator=gen) * 64).clamp(-448, 448).to(FP8)
        scale_rows = n if rows_per_scale == 1 else n // SCALE_BLOCK
        weight_scale = (torch.rand(scale_rows, k // SCALE_BLOCK, device="cuda", generator=gen) + 0.5) * k**-0.5 / 64
        if not (cublas.eligible(x, weight, weight_scale) and cublas.supported(x.device, weight, weight_scale)):
            pytest.skip("this torch or cuBLAS has no blockwise FP8 product")
        x_fp8, x_scale = fast.quantize_groups(x)
        want = ref.block_fp8_matmul(x_fp8, x_scale, weight, weight_scale, torch.float32)
        got = cublas.matmul(x_fp8, x_scale, weight, weight_scale, torch.bfloat16)
        # bf16 output (2^-7 relative) from fp32 sums; within each group the tensor cores' own
        # accumulation, as for the Triton kernel (test_fp8_gemm_triton.py).
        torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-8 * want.abs().max().item())
        triton_out = fast.fp8_linear(x, weight, weight_scale, use_cublas=False)
        torch.testing.assert_close(got.float(), triton_out.float(), rtol=2**-6, atol=2**-7 * want.abs().max().item())
        assert torch.equal(fast.fp8_linear(x, weight, weight_scale, use_cublas=True), got)  # the module's route
