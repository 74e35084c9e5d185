"""Decode GEMV microbenchmark: our Triton skinny GEMM vs cuBLAS at the Qwen3.5 shapes, M = 1..16.

At M <= 16 the product is a weight stream, so the number that matters is weight bytes per
second against the copy bandwidth measured in the same run (a 1 GiB device-to-device copy,
bytes read + written over time; a read-only stream can beat it, so > 100 % is possible).

For each shape x M x weight kind (bf16, FP8 per-channel scales, FP8 128x128 block scales):
  1. the heuristic's config and a handful of alternatives around it (tile width, K step,
     warps, stages, split-K, and the other inner product: FMA vs DOT), each checked against
     the fp32 reference first (a failing config is reported and skipped);
  2. each timed as a CUDA graph of back-to-back calls that rotate over enough weight copies
     that the weights touched between two uses of one copy exceed the 50 MB L2 several
     times (HBM, not L2), median over the replays, per call;
  3. baselines: cuBLAS F.linear on bf16 weights, and for FP8 torch._scaled_mm (row-wise
     scales, x pre-quantized to FP8 and padded to 16 rows: the kernel alone, without the
     activation quantization Fp8Linear also pays).

    python3 benchmarks/kernels/bench_gemv.py --out results.json [--quick]

Prints one line per timed variant as it goes; the JSON holds every row, the best config per
case and whether the heuristic picked it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere in the repo

from ninfer.kernels.gemv import ref  # noqa: E402
from ninfer.kernels.gemv import triton as gemv_fast  # noqa: E402

Config = gemv_fast.Config
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
L2_FLUSH_BYTES = 256 << 20  # weights touched between two uses of one copy: ~5x the H200's 50 MB L2
MIN_CALLS = 20  # calls per graph
KINDS = ("bf16", "fp8_channel", "fp8_block")
BATCHES = (1, 2, 4, 8, 16)
SHAPES = {
    # Qwen3.5-27B (hidden 5120)
    "27b_gdn_in_proj": (16480, 5120),
    "27b_gdn_out_proj": (5120, 6144),
    "27b_attn_qkv": (14336, 5120),
    "27b_o_proj": (5120, 6144),
    "27b_mlp_gate_up": (34816, 5120),
    "27b_mlp_down": (5120, 17408),
    "27b_lm_head": (248320, 5120),
    # Qwen3.5-35B-A3B (hidden 2048)
    "35b_gdn_in_proj": (12352, 2048),
    "35b_gdn_out_proj": (2048, 4096),
    "35b_attn_qkv": (9216, 2048),
    "35b_shared_gate_up": (1024, 2048),
    "35b_shared_down": (2048, 512),
    "35b_router": (256, 2048),
    "35b_lm_head": (248320, 2048),
}
# 27B o_proj has gdn_out_proj's shape: timed once under the GDN name.
DUPLICATE_SHAPES = {"27b_o_proj": "27b_gdn_out_proj"}
QUICK_SHAPES = ("27b_gdn_in_proj", "27b_gdn_out_proj", "27b_mlp_down", "27b_lm_head", "35b_gdn_out_proj", "35b_router")
QUICK_BATCHES = (1, 4, 16)
NUM_SMS_H200 = 132


# ---------------------------------------------------------------- configs (no GPU needed)


def weight_dtype(kind: str) -> torch.dtype:
    return torch.bfloat16 if kind == "bf16" else FP8


def valid(cfg: Config, k: int, kind: str, m: int) -> bool:
    vec = 16 // (2 if kind == "bf16" else 1)
    if cfg.use_dot:
        return cfg.block_n >= 16 and cfg.block_k >= 16 and cfg.block_k <= max(16, 1 << (k - 1).bit_length())
    # FMA: one 16-byte vector per thread per row and step (else Triton shuffles x through
    # shared memory every step); fp32 accumulators grow with M.
    return cfg.block_k % vec == 0 and cfg.block_k // vec >= 32 * cfg.num_warps and m <= 8


def sweep_configs(m: int, n: int, k: int, kind: str, num_sms: int, quick: bool = False) -> list[Config]:
    """The heuristic's config first, then a handful of neighbours (deduplicated, valid only)."""
    base = gemv_fast._config(m, n, k, weight_dtype(kind), num_sms)
    alts: list[Config] = []
    other = gemv_fast._config(16 if not base.use_dot else 1, n, k, weight_dtype(kind), num_sms)
    if base.use_dot:
        alts += [
            base._replace(block_n=base.block_n * 2, num_warps=4),
            base._replace(num_stages=base.num_stages - 1 if base.num_stages > 2 else 3),
            base._replace(block_k=base.block_k * 2, num_stages=3),
        ]
        if base.block_n > 16:
            alts.append(base._replace(block_n=base.block_n // 2))
        if m <= 8:
            alts.append(other)  # FMA at this M
    else:
        alts += [
            base._replace(block_n=base.block_n * 2),
            base._replace(block_k=base.block_k * 2, num_warps=min(8, base.num_warps * 2)),
        ]
        if base.block_n > 1:
            alts.append(base._replace(block_n=base.block_n // 2))
        if m > 1:
            alts.append(other._replace(split_k=base.split_k))  # DOT at this M
    alts.append(base._replace(split_k=base.split_k * 2))
    if base.split_k > 1:
        alts.append(base._replace(split_k=1))
    seen, configs = set(), []
    for i, cfg in enumerate([base] + alts[: 3 if quick else len(alts)]):
        if cfg not in seen and (i == 0 or valid(cfg, k, kind, m)):
            seen.add(cfg)
            configs.append(cfg)
    return configs


def plan(quick: bool, num_sms: int = NUM_SMS_H200) -> list[tuple[str, int, str, list[Config]]]:
    cases = []
    for name in QUICK_SHAPES if quick else SHAPES:
        if name in DUPLICATE_SHAPES:
            continue
        n, k = SHAPES[name]
        for m in QUICK_BATCHES if quick else BATCHES:
            for kind in KINDS:
                cases.append((name, m, kind, sweep_configs(m, n, k, kind, num_sms, quick)))
    return cases


def config_str(cfg: Config) -> str:
    path = "dot" if cfg.use_dot else "fma"
    return f"{path} n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} split{cfg.split_k}"


# ---------------------------------------------------------------- GPU parts


def make_weight(n: int, k: int, kind: str, gen: torch.Generator):
    """(weight, scale) quantized as checkpoints are (absmax scales per channel or 128x128 block)."""
    w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
    if kind == "bf16":
        return w.bfloat16(), None
    if kind == "fp8_channel":
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
        return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.zeros(nb * 128, kb * 128, device="cuda")
    padded[:n, :k] = w
    blocks = padded.view(nb, 128, kb, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    quantized = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * 128, kb * 128)
    return quantized[:n, :k].contiguous().to(FP8), scale


def median_call_seconds(calls, replays: int) -> float:
    """Median time per call of a CUDA graph that runs every callable in `calls` once."""
    for fn in calls:  # warm-up and compile outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times) / len(calls)


def copy_bandwidth(num_bytes: int = 1 << 30) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * num_bytes / statistics.median(times)


def exact_fp32(x, weight, scale) -> torch.Tensor:
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return x.float() @ ref.dequantize(weight, scale).T
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def matches(out: torch.Tensor, expected: torch.Tensor) -> bool:
    # One bf16 rounding (2^-9 relative) with margin for the fp32 summation order.
    err = (out.float() - expected).abs()
    return bool(torch.isfinite(out).all()) and bool((err <= expected.abs() * 2**-8 + 1e-3 * expected.abs().max()).all())


def bench_case(name, m, kind, configs, bandwidth, replays, gen, cublas_cache) -> dict:
    n, k = SHAPES[name]
    weight, scale = make_weight(n, k, kind, gen)
    weight_bytes = weight.numel() * weight.element_size() + (0 if scale is None else scale.numel() * 4)
    copies = max(1, math.ceil(L2_FLUSH_BYTES / weight_bytes))
    num_calls = max(MIN_CALLS, copies)
    weights = [(weight, scale)] + [
        (weight.clone(), None if scale is None else scale.clone()) for _ in range(copies - 1)
    ]
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    expected = exact_fp32(x, weight, scale)
    floor_us = weight_bytes / bandwidth * 1e6
    rows = []

    def record(impl: str, cfg: Config | None, seconds: float | None, note: str = "") -> None:
        row = {
            "shape": name,
            "n": n,
            "k": k,
            "m": m,
            "kind": kind,
            "impl": impl,
            "config": None if cfg is None else cfg._asdict(),
            "us": None if seconds is None else seconds * 1e6,
            "weight_bytes": weight_bytes,
            "floor_us": floor_us,
            "gb_per_s": None if seconds is None else weight_bytes / seconds / 1e9,
            "fraction_of_copy_bw": None if seconds is None else weight_bytes / seconds / bandwidth,
            "note": note,
        }
        rows.append(row)
        label = impl if cfg is None else f"{impl} {config_str(cfg)}"
        timing = "failed" if seconds is None else (
            f"{row['us']:9.2f} us {row['gb_per_s']:7.0f} GB/s {row['fraction_of_copy_bw']:6.1%}"
        )
        print(f"{name:20} M={m:<2} {kind:11} {label:46} {timing} {note}", flush=True)

    for i, cfg in enumerate(configs):
        impl = "triton_default" if i == 0 else "triton"
        try:
            out = gemv_fast.gemv(x, weight, scale, config=cfg)
            if not matches(out, expected):
                record(impl, cfg, None, "wrong output: skipped")
                continue
            calls = [
                (lambda w=w, s=s: gemv_fast.gemv(x, w, s, config=cfg)) for w, s in (weights * num_calls)[:num_calls]
            ]
            record(impl, cfg, median_call_seconds(calls, replays))
        except Exception as exc:  # noqa: BLE001 - a config too big for shared memory / registers
            record(impl, cfg, None, f"{type(exc).__name__}: {str(exc)[:80]}")

    # Baselines. cuBLAS bf16 once per (shape, M) (KINDS starts with bf16), shared by the
    # FP8 rows as the reference point for their speed-up.
    if kind == "bf16":
        calls = [(lambda w=w: torch.nn.functional.linear(x, w)) for w, _ in (weights * num_calls)[:num_calls]]
        cublas_cache[(name, m)] = median_call_seconds(calls, replays)
        record("cublas_linear_bf16", None, cublas_cache[(name, m)])
    else:
        x8 = torch.zeros(16, k, device="cuda", dtype=FP8)
        x8[:m] = x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)
        x_scale = torch.ones(16, 1, device="cuda")
        # Row-wise scales for both FP8 kinds (block scales: the first K block's): same cost.
        row_scales = [(s if s.dim() == 1 else s.repeat_interleave(128, 0)[:n, 0].contiguous()).view(1, -1) for _, s in weights]
        calls = [
            (lambda w=w, rs=rs: torch._scaled_mm(x8, w.t(), scale_a=x_scale, scale_b=rs, out_dtype=torch.bfloat16))
            for (w, _), rs in (list(zip(weights, row_scales)) * num_calls)[:num_calls]
        ]
        try:
            record("scaled_mm_fp8_rowwise", None, median_call_seconds(calls, replays))
        except Exception as exc:  # noqa: BLE001
            record("scaled_mm_fp8_rowwise", None, None, f"{type(exc).__name__}: {str(exc)[:80]}")
    bf16_us = cublas_cache.get((name, m), float("nan")) * 1e6

    timed = [r for r in rows if r["impl"].startswith("triton") and r["us"] is not None]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    default = next((r for r in timed if r["impl"] == "triton_default"), None)
    summary = {
        "shape": name,
        "n": n,
        "k": k,
        "m": m,
        "kind": kind,
        "weight_bytes": weight_bytes,
        "calls_per_graph": num_calls,
        "weight_copies": copies,
        "default_config": configs[0]._asdict(),
        "default_us": None if default is None else default["us"],
        "best_config": None if best is None else best["config"],
        "best_us": None if best is None else best["us"],
        "best_fraction_of_copy_bw": None if best is None else best["fraction_of_copy_bw"],
        "heuristic_is_best": best is not None and default is not None and best is default,
        "default_within_5pct_of_best": best is not None and default is not None and default["us"] <= 1.05 * best["us"],
        "cublas_bf16_us": bf16_us,
        "speedup_vs_cublas_bf16": None if best is None else bf16_us / best["us"],
        "scaled_mm_us": next((r["us"] for r in rows if r["impl"] == "scaled_mm_fp8_rowwise"), None),
    }
    del weights
    return {"rows": rows, "summary": summary}


def _compile_worker(tasks: list[tuple[int, int, int, str, tuple]]) -> int:
    """Compile (and launch once, on uninitialised weights) each task's kernel variant:
    fills Triton's on-disk cache so the timed process only loads cubins."""
    shapes: dict = {}
    for n, k, m, kind, cfg in tasks:
        if (n, k, kind) not in shapes:
            shapes.clear()
            w = torch.empty(n, k, device="cuda", dtype=weight_dtype(kind))
            s = None if kind == "bf16" else (
                torch.ones(n, device="cuda") if kind == "fp8_channel" else torch.ones(-(-n // 128), -(-k // 128), device="cuda")
            )
            shapes[(n, k, kind)] = (w, s)
        w, s = shapes[(n, k, kind)]
        try:
            gemv_fast.gemv(torch.zeros(m, k, device="cuda", dtype=torch.bfloat16), w, s, config=Config(*cfg))
        except Exception:  # noqa: BLE001 - reported by the timed run
            pass
    torch.cuda.synchronize()
    return len(tasks)


def precompile(cases, workers: int) -> None:
    """Triton compiles one variant at a time (~1 s each, ~160 variants in the full plan):
    spread the compiles over worker processes first."""
    import multiprocessing as mp

    tasks = {(*SHAPES[name], m, kind, tuple(cfg)) for name, m, kind, cfgs in cases for cfg in cfgs}
    # Sorted by variant, in contiguous slices: one variant's tasks (which differ only in
    # shape) mostly land on one worker and compile once.
    tasks = sorted(tasks, key=lambda t: (t[3], t[4], t[2], t[1], t[0]))
    size = -(-len(tasks) // workers)
    chunks = [tasks[i : i + size] for i in range(0, len(tasks), size)]
    with mp.get_context("spawn").Pool(len(chunks)) as pool:
        pool.map(_compile_worker, chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write results here (JSON)")
    parser.add_argument("--quick", action="store_true", help="6 shapes, M in (1, 4, 16), 3 alternatives: < 90 s")
    parser.add_argument("--plan", action="store_true", help="print the cases and configs, no GPU needed")
    parser.add_argument("--compile-workers", type=int, default=12, help="processes that pre-compile the kernels (0: none)")
    args = parser.parse_args()
    if args.plan:
        cases = plan(args.quick)
        variants = {(kind, cfg, gemv_fast.DOT_ROWS if cfg.use_dot else 1 << (m - 1).bit_length()) for _, m, kind, cfgs in cases for cfg in cfgs}
        for name, m, kind, cfgs in cases:
            print(name, m, kind, "; ".join(config_str(c) for c in cfgs))
        print(f"{len(cases)} cases, {sum(len(c[3]) for c in cases)} timed configs, ~{len(variants)} kernel variants")
        return
    started = time.time()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = plan(args.quick, num_sms)
    if args.compile_workers > 0:
        precompile(cases, args.compile_workers)
        print(f"compiled the plan's kernels in {time.time() - started:.0f} s ({args.compile_workers} processes)")
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} ({num_sms} SMs): copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    replays = 10
    gen = torch.Generator("cuda").manual_seed(0)
    cublas_cache: dict = {}
    results = []
    for name, m, kind, configs in cases:
        results.append(bench_case(name, m, kind, configs, bandwidth, replays, gen, cublas_cache))
        torch.cuda.empty_cache()
    summaries = [r["summary"] for r in results]

    print("\nBest per case (fraction of copy bandwidth; * = heuristic's config was the best)")
    print(f"{'shape':20} {'M':>2} {'kind':11} {'default us':>10} {'best us':>9} {'best bw':>7} {'cuBLAS bf16':>11} {'scaled_mm':>9}")
    for s in summaries:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(
            f"{s['shape']:20} {s['m']:>2} {s['kind']:11} {fmt(s['default_us'], '10.2f')} {fmt(s['best_us'], '9.2f')}"
            f"{'*' if s['heuristic_is_best'] else ' '}{fmt(s['best_fraction_of_copy_bw'], '6.1%')} "
            f"{s['cublas_bf16_us']:11.2f} {fmt(s['scaled_mm_us'], '9.2f')}"
        )
    picked = sum(s["heuristic_is_best"] for s in summaries)
    close = sum(s["default_within_5pct_of_best"] for s in summaries)
    elapsed = time.time() - started
    print(f"heuristic best in {picked}/{len(summaries)} cases, within 5 % in {close}; {elapsed:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "num_sms": num_sms,
                    "copy_bandwidth": bandwidth,
                    "quick": args.quick,
                    "seconds": elapsed,
                    "summaries": summaries,
                    "rows": [row for r in results for row in r["rows"]],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
