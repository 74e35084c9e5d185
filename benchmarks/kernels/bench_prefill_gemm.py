"""Prefill matrix products of the quantized formats against bf16, at the 27B's projection shapes.

Each format runs as its Linear module runs it at prefill sizes (activation quantization
included): bf16 on cuBLAS; FP8 per output channel (tokens quantized per row, torch._scaled_mm);
Qwen's block-scaled FP8 (tokens quantized per 128 columns, kernels/fp8_gemm) as the module runs
it, then cuBLAS's blockwise product (where torch has it) and the Triton kernel at its default tile,
each with 128 x 128 and with the loader's row-block scales, and the Triton kernel's other tiles; NVFP4 (kernels/nvfp4_gemm) as the module runs it (from
DEQUANTIZED_MIN_ROWS rows a dequantized bf16 copy, then cuBLAS) and its in-register kernel
at the default tile and a few around it; first the NVFP4 dequantization alone (its GB/s against
the copy bandwidth, the default tile and others). Each variant
is first checked against the fp32 product of its own dequantized weight (a failing one is
reported and skipped), then timed: CUDA-event median of graph-replayed calls after warm-up.
Rates are in TFLOP/s next to the bf16 8192^3 matmul rate measured in the same run.

    python3 benchmarks/kernels/bench_prefill_gemm.py --out /tmp/prefill-gemm.json [--rows 1024,8192] [--shapes ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere in the repo

from ninfer.kernels.fp8_gemm import triton as fp8_gemm  # noqa: E402
from ninfer.kernels.nvfp4_gemm import triton as nvfp4_gemm  # noqa: E402
from ninfer.kernels.gemv.ref import SCALE_BLOCK  # noqa: E402
from ninfer.models.quant.fp8 import Fp8Linear  # noqa: E402
from ninfer.models.quant.nvfp4 import Nvfp4Linear  # noqa: E402
from timing import median_seconds  # noqa: E402  benchmarks/kernels/timing.py

SHAPES = {  # (N, K) of the 27B's projections
    "27b_gdn_in_proj": (16480, 5120),
    "27b_gdn_out_proj": (5120, 6144),
    "27b_attn_qkv": (14336, 5120),
    "27b_mlp_gate_up": (34816, 5120),
    "27b_mlp_down": (5120, 17408),
}
ROWS = (512, 1024, 8192)
NVFP4_TILES = (  # (block_m, block_n, block_k, warps, stages) around the default table
    nvfp4_gemm.Config(128, 128, 128, 8, 3),
    nvfp4_gemm.Config(256, 128, 128, 8, 2),
    nvfp4_gemm.Config(128, 256, 128, 8, 2),
    nvfp4_gemm.Config(128, 128, 64, 8, 4),
    nvfp4_gemm.Config(64, 128, 128, 4, 4),
)


def matmul_rate() -> float:
    """bf16 8192^3 on cuBLAS, FLOP/s."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / median_seconds(lambda: a @ b, replays=20)


def bench_case(name: str, rows: int, replays: int) -> list[dict]:
    n, k = SHAPES[name]
    gen = torch.Generator("cuda").manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen, device="cuda") * k**-0.5)
    x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
    flops = 2 * rows * n * k
    results: list[dict] = []

    def record(fmt: str, variant: str, fn, weight_fp32: torch.Tensor) -> None:
        try:
            expected = x[:256].float() @ weight_fp32.t()
            out = fn()[:256].float()
            err = ((out - expected).norm() / expected.norm()).item()
            # e4m3 activations alone put the FP8 formats near 2.6% (H100); a wrong kernel is off by ~100%.
            if err > (6e-2 if fmt.startswith("fp8") else 2e-2):
                print(f"{name:18s} M={rows:<5d} {fmt:10s} {variant:34s} WRONG (relative error {err:.3g})", flush=True)
                results.append({"shape": name, "m": rows, "format": fmt, "variant": variant, "error": err})
                return
            seconds = median_seconds(fn, replays=replays)
        except Exception as error:  # noqa: BLE001 - a launch shape the device cannot take is reported, not fatal
            print(f"{name:18s} M={rows:<5d} {fmt:10s} {variant:34s} not run: {str(error)[:120]}", flush=True)
            return
        row = {"shape": name, "m": rows, "format": fmt, "variant": variant, "us": seconds * 1e6, "tflops": flops / seconds / 1e12}
        results.append(row)
        print(f"{name:18s} M={rows:<5d} {fmt:10s} {variant:34s} {seconds * 1e6:9.1f} us {row['tflops']:6.0f} TFLOP/s", flush=True)

    with torch.no_grad():
        record("bf16", "cublas", lambda: linear(x), linear.weight.float())
        per_channel = Fp8Linear.from_linear(linear)
        record("fp8", "per channel, _scaled_mm", lambda: per_channel(x), per_channel.dequantized(torch.float32))
        blocks = Fp8Linear.from_linear_blocks(linear)
        block_weight = blocks.dequantized(torch.float32)
        record("fp8-block", "default", lambda: blocks(x), block_weight)
        # The module keeps the loader's layout, one scale row per weight row; a 128-row block's
        # rows share theirs, so every 128th row is the checkpoint's 128 x 128 block scales.
        block_scales = blocks.weight_scale[::SCALE_BLOCK].contiguous()
        for label, scale in (("128 x 128 scales", block_scales), ("row-block scales (loader's)", blocks.weight_scale)):
            record("fp8-block", f"cuBLAS blockwise, {label}",
                   lambda scale=scale: fp8_gemm.fp8_linear(x, blocks.weight, scale, use_cublas=True), block_weight)  # fmt: skip
            record("fp8-block", f"Triton kernel, {label}",
                   lambda scale=scale: fp8_gemm.fp8_linear(x, blocks.weight, scale, use_cublas=False), block_weight)  # fmt: skip
        for cfg in fp8_gemm.TILES:
            record("fp8-block", str(tuple(cfg)),
                   lambda cfg=cfg: fp8_gemm.fp8_linear(x, blocks.weight, blocks.weight_scale, config=cfg), block_weight)  # fmt: skip
        nvfp4 = Nvfp4Linear.from_linear(linear)
        nvfp4_weight = nvfp4.dequantized(torch.float32)
        record("nvfp4", "default", lambda: nvfp4(x), nvfp4_weight)
        for cfg in NVFP4_TILES:
            record("nvfp4", str(tuple(cfg)),
                   lambda cfg=cfg: nvfp4_gemm.nvfp4_matmul(x, nvfp4.weight, nvfp4.block_scale, nvfp4.row_scale, config=cfg),
                   nvfp4_weight)  # fmt: skip
        kernel_tile = nvfp4_gemm._config(rows, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
        record("nvfp4", "in-register kernel, default tile",
               lambda: nvfp4_gemm.nvfp4_matmul(x, nvfp4.weight, nvfp4.block_scale, nvfp4.row_scale, config=kernel_tile),
               nvfp4_weight)  # fmt: skip
    return results


DEQUANTIZE_TILES = ((32, 256), (16, 256), (64, 128), (32, 512), (8, 1024))  # (block_n, block_k)


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_seconds(lambda: dst.copy_(src), replays=10)


def bench_dequantize(name: str, replays: int, bandwidth: float) -> list[dict]:
    """The NVFP4 weight's dequantized bf16 copy alone (what the prefill route adds to cuBLAS):
    the default tile and a few others, against the copy bandwidth for its bytes moved."""
    n, k = SHAPES[name]
    torch.manual_seed(0)
    nvfp4 = Nvfp4Linear.from_linear(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
    operands = (nvfp4.weight, nvfp4.block_scale, nvfp4.row_scale)
    expected = nvfp4.dequantized(torch.bfloat16)
    moved = n * k // 2 + n * k // 16 + n * 4 + n * k * 2  # codes, block and row scales read; the copy written
    results = []
    for block_n, block_k in ((None, None), *DEQUANTIZE_TILES):
        tile = {} if block_n is None else {"block_n": block_n, "block_k": block_k}
        variant = "dequantize, default tile" if not tile else f"dequantize {block_n} x {block_k}"
        fn = lambda tile=tile: nvfp4_gemm.dequantize_nvfp4(*operands, torch.bfloat16, **tile)  # noqa: E731
        if not torch.equal(fn(), expected):
            print(f"{name:18s} {variant:34s} WRONG", flush=True)
            continue
        seconds = median_seconds(fn, replays=replays)
        row = {"shape": name, "format": "nvfp4", "variant": variant, "us": seconds * 1e6,
               "bytes_per_s": moved / seconds, "bandwidth_fraction": moved / seconds / bandwidth}  # fmt: skip
        results.append(row)
        print(f"{name:18s} {variant:34s} {seconds * 1e6:9.1f} us {moved / seconds / 1e9:6.0f} GB/s "
              f"({row['bandwidth_fraction']:.0%} of copy)", flush=True)  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write every row here (JSON)")
    parser.add_argument("--shapes", help=f"comma-separated subset of {', '.join(SHAPES)}")
    parser.add_argument("--rows", help="comma-separated M values (default 512,1024,8192)")
    parser.add_argument("--replays", type=int, default=10)
    args = parser.parse_args()
    shapes = args.shapes.split(",") if args.shapes else list(SHAPES)
    rows = [int(m) for m in args.rows.split(",")] if args.rows else list(ROWS)
    rate = matmul_rate()
    print(f"{torch.cuda.get_device_name()}: bf16 8192^3 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    dequantized = [row for name in shapes for row in bench_dequantize(name, args.replays, bandwidth)]
    results = [row for name in shapes for m in rows for row in bench_case(name, m, args.replays)]
    for name in shapes:
        for m in rows:
            case = [r for r in results if r["shape"] == name and r["m"] == m and "us" in r]
            bf16 = next((r for r in case if r["format"] == "bf16"), None)
            if bf16 is None:
                continue
            best = {}
            for r in case:
                if r["format"] != "bf16" and (r["format"] not in best or r["us"] < best[r["format"]]["us"]):
                    best[r["format"]] = r
            shown = " · ".join(f"{fmt} {r['tflops']:.0f} ({bf16['us'] / r['us']:.2f}x, {r['variant']})" for fmt, r in best.items())
            print(f"{name:18s} M={m:<5d} bf16 {bf16['tflops']:.0f} TFLOP/s · {shown}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "bf16_matmul_flops": rate,
                                              "copy_bandwidth": bandwidth, "dequantize": dequantized,
                                              "rows": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
