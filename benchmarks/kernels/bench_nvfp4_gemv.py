"""NVFP4 GEMV microbenchmark: the FMA path's default launch and tiles around it (each also with
its loads double-buffered, `fma_tile_db`), tensor-core
(DOT) launches around a few tile shapes and K splits, the default launch, and cuBLAS on the
same matrix in bf16, at the 27B shapes and M = 1..16.

The weight is a stream of 0.5625 bytes per value (codes and e4m3 block scales), so each
variant is reported as those bytes per second against the copy bandwidth measured in the same
run. Each timing is a CUDA graph of back-to-back calls rotating over enough weight copies that
the bytes touched between two uses of one copy exceed the L2 several times (HBM, not L2),
median per call. Every variant is checked against the fp32 product of the dequantized weight
first (bf16 rounding of the output allowed); a variant that fails is reported and skipped.

    python3 benchmarks/kernels/bench_nvfp4_gemv.py --out /tmp/nvfp4-gemv.json [--batches 1,8] [--shapes ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere in the repo

from ninfer.kernels.nvfp4_gemv import ref  # noqa: E402
from ninfer.kernels.nvfp4_gemv import triton as fast  # noqa: E402
from ninfer.kernels.sm_count import device_sms  # noqa: E402
from timing import copy_bandwidth, median_seconds  # noqa: E402  benchmarks/kernels/timing.py

SHAPES = {  # (N, K) of the 27B's decode projections
    "27b_gdn_in_proj": (16480, 5120),
    "27b_gdn_out_proj": (5120, 6144),
    "27b_attn_qkv": (14336, 5120),
    "27b_mlp_gate_up": (34816, 5120),
    "27b_mlp_down": (5120, 17408),
}
BATCHES = (1, 2, 4, 8, 16)
L2_FLUSH_BYTES = 256 << 20
MIN_CALLS = 20


def dot_configs() -> list[fast.Config]:
    """Tensor-core tiles: 16 weight rows per warp (the MMA's A operand), K steps of 64-256."""
    tiles = [(16, 64, 1), (32, 128, 2), (64, 128, 4), (64, 256, 4), (128, 128, 8)]
    return [fast.Config(n, k, num_warps=w, use_dot=True, num_stages=s) for n, k, w in tiles for s in (2, 4)]


def fma_configs(m: int, n: int, k: int) -> list[fast.Config]:
    """The FMA path around its default: 2, 4 and 8 weight rows per program, K steps of 1,024 codes
    on 2 warps and 2,048 on 4 (one vector a thread and row), up to 4 rows of x."""
    if m > 4:
        return []
    default = fast._config(m, n, k, device_sms(torch.device("cuda")))
    vec = 2 * default.vec_bytes
    return [default._replace(block_n=rows, block_k=step, num_warps=step // (vec * 32)) for rows in (2, 4, 8) for step in (1024, 2048)]


def bench_case(name: str, m: int, bandwidth: float, replays: int) -> list[dict]:
    n, k = SHAPES[name]
    gen = torch.Generator("cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
    packed, block_scale, row_scale = ref.quantize_nvfp4(w)
    weight_bytes = packed.numel() + block_scale.numel()
    copies = max(1, -(-L2_FLUSH_BYTES // weight_bytes))
    weights = [(packed.clone(), block_scale.clone(), row_scale.clone()) for _ in range(copies)]
    num_calls = max(MIN_CALLS, copies)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    expected = (x.double() @ ref.dequantize_nvfp4(packed, block_scale, row_scale).double().T).float()
    rows = []

    def record(impl: str, cfg, seconds: float | None, note: str = "") -> None:
        row = {"shape": name, "m": m, "impl": impl, "config": None if cfg is None else cfg._asdict(),
               "us": None if seconds is None else seconds * 1e6, "note": note}
        if seconds is not None:
            row["bandwidth_fraction"] = weight_bytes / seconds / bandwidth
        rows.append(row)
        shown = f"{seconds * 1e6:9.2f} us {row['bandwidth_fraction']:6.1%}" if seconds is not None else note
        print(f"{name:18s} M={m:<3d} {impl:14s} {'' if cfg is None else str(tuple(cfg)):48s} {shown}", flush=True)

    # The default decode (PTX lookup) and the fp16 bit decode beside it (PTX_DECODE off).
    dots = dot_configs()
    variants = [("fma_default", None, True), ("fma_fp16_decode", None, False)]
    variants += [("fma_tile", cfg, True) for cfg in fma_configs(m, n, k)]
    # The same tiles with each step's loads issued before the step before it is computed.
    variants += [("fma_tile_db", cfg._replace(double_buffer=True), True) for cfg in fma_configs(m, n, k)]
    variants += [("dot", cfg, True) for cfg in dots]
    variants += [("dot_fp16_decode", cfg, False) for cfg in dots[2:4]]
    variants += [("dot_split", fast.DOT_TILE._replace(split_k=split), True) for split in (2, 4, 8)]
    default_dot = fast._config(m, n, k, device_sms(x.device), dot=True)
    variants += [("dot_default", default_dot, True)]
    if default_dot.use_dot:  # deeper pipelines: the path waits on its loads (docs/kernels.md)
        variants += [("dot_stages", default_dot._replace(num_stages=stages), True) for stages in (3, 6)]
    for impl, cfg, ptx in variants:
        fast.PTX_DECODE = ptx
        try:
            out = fast.gemv_nvfp4(x, packed, block_scale, row_scale, config=cfg)
        except ValueError as error:
            record(impl, cfg, None, f"not run: {error}")
            continue
        scale = expected.abs().max().item()
        if not torch.allclose(out.float(), expected, rtol=2**-7, atol=1e-3 * scale):
            record(impl, cfg, None, "WRONG: differs from the reference")
            continue
        calls = [(lambda p=p, s=s, r=r: fast.gemv_nvfp4(x, p, s, r, config=cfg)) for p, s, r in (weights * num_calls)[:num_calls]]
        record(impl, cfg, median_seconds(lambda: [c() for c in calls], replays=replays) / num_calls)
    fast.PTX_DECODE = True
    dense = [w.bfloat16() for _ in range(max(1, -(-L2_FLUSH_BYTES // (2 * n * k))))]
    calls = [(lambda d=d: torch.nn.functional.linear(x, d)) for d in (dense * MIN_CALLS)[:MIN_CALLS]]
    seconds = median_seconds(lambda: [c() for c in calls], replays=replays) / MIN_CALLS
    rows.append({"shape": name, "m": m, "impl": "cublas_bf16", "us": seconds * 1e6, "bandwidth_fraction": 2 * n * k / seconds / bandwidth})
    print(f"{name:18s} M={m:<3d} {'cublas_bf16':14s} {'(the same matrix in bf16)':48s} {seconds * 1e6:9.2f} us", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write every row here (JSON)")
    parser.add_argument("--shapes", help=f"comma-separated subset of {', '.join(SHAPES)}")
    parser.add_argument("--batches", help="comma-separated M values (default 1,2,4,8,16)")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    shapes = args.shapes.split(",") if args.shapes else list(SHAPES)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else list(BATCHES)
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} ({device_sms(torch.device('cuda'))} SMs): copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = [row for name in shapes for m in batches for row in bench_case(name, m, bandwidth, args.replays)]
    for name in shapes:
        for m in batches:
            case = [r for r in rows if r["shape"] == name and r["m"] == m and r.get("us")]
            fma = next((r for r in case if r["impl"] == "fma_default"), None)
            dot = min((r for r in case if r["impl"] == "dot"), key=lambda r: r["us"], default=None)
            old = next((r for r in case if r["impl"] == "fma_fp16_decode"), None)
            if fma and dot:
                print(f"{name:18s} M={m:<3d} FMA {fma['us']:8.2f} us ({fma['bandwidth_fraction']:.0%}) · best DOT "
                      f"{dot['us']:8.2f} us ({dot['bandwidth_fraction']:.0%}) {tuple(dot['config'].values())}"
                      + (f" · FMA, fp16 decode {old['us']:8.2f} us" if old else ""))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth,
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
