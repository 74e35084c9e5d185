"""Decode GEMV microbenchmark: our Triton skinny GEMM vs cuBLAS at the Qwen3.5 shapes, M = 1..32.

At M <= 32 the product is a weight stream, so the number that matters is weight bytes per
second against the copy bandwidth measured in the same run (a 1 GiB device-to-device copy,
bytes read + written over time; a read-only stream can beat it, so > 100 % is possible).

For each shape x M x weight kind (bf16, FP8 per-channel scales, FP8 128x128 block scales):
  1. the heuristic's config and a handful of alternatives around it (tile width / warps,
     stages, split-K, K step, and the other inner product: FMA vs DOT), each checked
     against the fp32 reference first (a failing config is reported and skipped);
  2. each timed as a CUDA graph of back-to-back calls in one stream that rotate over
     enough weight copies that the weights touched between two uses of one copy exceed the
     50 MB L2 several times (HBM, not L2), median over the replays, per call. The calls
     share x and do not feed each other, but with PDL (NINFER_PDL, on by default on sm_90)
     each launch still waits in pdl_sync for the previous kernel to complete, as in a
     chain of dependent layers: what PDL saves is the launch gap and prologue in between.
     The heuristic's config is timed with PDL on and off (--no-pdl: off everywhere);
  3. baselines: cuBLAS F.linear on bf16 weights, and for FP8 torch._scaled_mm (row-wise
     scales, x pre-quantized to FP8 and padded to a multiple of 16 rows: the kernel alone, without the
     activation quantization Fp8Linear also pays), in the same kind of graph.

    python3 benchmarks/kernels/bench_gemv.py --out results.json [--quick] [--no-pdl]
    python3 benchmarks/kernels/bench_gemv.py --plan [--quick]   # cases, configs, time estimate; no GPU

Prints one line per timed variant as it goes, then per case: the heuristic's pick, the
best config, cuBLAS bf16 and _scaled_mm; the JSON holds every row and the summaries.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere in the repo

from ninfer.kernels.gemv import ref  # noqa: E402
from ninfer.kernels.gemv import triton as gemv_fast  # noqa: E402
from timing import copy_bandwidth, median_seconds  # noqa: E402  benchmarks/kernels/timing.py (run as a script)


def median_call_seconds(calls, replays: int) -> float:
    """Median time per call of a CUDA graph that runs every callable in `calls` once."""
    return median_seconds(lambda: [fn() for fn in calls], replays=replays) / len(calls)

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
# --quick: every 27B shape (o_proj is gdn_out_proj's) and two small-N 35B ones (split-K),
# every M; the heuristic's config (PDL on and off) and QUICK_ALTERNATIVES neighbours.
QUICK_SHAPES = (
    "27b_gdn_in_proj",
    "27b_gdn_out_proj",
    "27b_attn_qkv",
    "27b_mlp_gate_up",
    "27b_mlp_down",
    "27b_lm_head",
    "35b_gdn_out_proj",
    "35b_router",
)
QUICK_BATCHES = BATCHES
QUICK_ALTERNATIVES = 2
NUM_SMS_H200 = 132
H200_BYTES_PER_S = 4.2e12  # for --plan's time estimate only


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
    """The heuristic's config first, then its neighbours, most telling first (deduplicated,
    valid only; quick: the first QUICK_ALTERNATIVES)."""
    dtype = weight_dtype(kind)
    base = gemv_fast._config(m, n, k, dtype, num_sms)
    fp8 = kind != "bf16"
    alts: list[Config] = []
    if base.use_dot:
        fma = gemv_fast._config(1, n, k, dtype, num_sms)  # FMA's launch for this N, K
        if fp8:
            # Weight rows per warp (16 per MMA; 32 share each x fragment) and program.
            if base.block_n == 64:
                alts += [base._replace(block_n=32, num_warps=1), base._replace(block_n=128)]
            elif base.block_n == 32:
                alts += [base._replace(block_n=64, num_warps=2), base._replace(block_n=16)]
            else:
                alts += [base._replace(block_n=32)]
        else:
            if base.block_n == 32:
                alts += [base._replace(block_n=16, num_warps=2), base._replace(block_n=64)]
            elif base.block_n == 16:
                alts += [base._replace(block_n=32, num_warps=4)]
            else:
                alts += [base._replace(block_n=32)]
        if m <= (2 if fp8 else 4):
            alts.insert(1, fma)  # the other inner product, near the switch
        alts += [
            base._replace(num_stages=3),
            base._replace(split_k=1) if base.split_k > 1 else base._replace(split_k=2),
            base._replace(block_k=base.block_k * 2, num_stages=3),
        ]
    else:
        # DOT's launch at the smallest M where the heuristic takes it, at this M (FP8 at
        # M = 2 keeps FMA on wide matrices: then M = 4's DOT launch and its neighbours).
        dot = gemv_fast._config(2 if fp8 else 4, n, k, dtype, num_sms)
        if not dot.use_dot:
            dot = gemv_fast._config(4, n, k, dtype, num_sms)
            alts += [dot._replace(block_n=width, num_warps=max(1, width // 32)) for width in (16, 32, 64) if width != dot.block_n]
        alts += [dot, base._replace(block_n=base.block_n * 2)]
        if base.block_n > 1:
            alts.append(base._replace(block_n=base.block_n // 2))
        alts += [
            base._replace(block_k=base.block_k * 2, num_warps=min(8, base.num_warps * 2)),
            base._replace(split_k=base.split_k * 2),
        ]
        if base.split_k > 1:
            alts.append(base._replace(split_k=1))
    seen, configs = {base}, [base]
    for cfg in alts:
        if len(configs) > (QUICK_ALTERNATIVES if quick else len(alts)):
            break
        if cfg not in seen and valid(cfg, k, kind, m):
            seen.add(cfg)
            configs.append(cfg)
    return configs


def wide_configs(m: int, n: int, k: int, kind: str, num_sms: int) -> list[Config]:
    """--wide: the heuristic's config, then every FMA tile (rows per program, K step and
    warps, 1 or 2 vectors per thread and row, weight prefetch off and on) and the DOT
    neighbours that sweep_configs would try."""
    base = gemv_fast._config(m, n, k, weight_dtype(kind), num_sms)
    vec = 16 // (2 if kind == "bf16" else 1)
    grid = [
        Config(block_n, vec * 32 * warps * vectors, warps, 1, False, 1, prefetch)
        for block_n in (1, 2, 4, 8)
        for warps in (1, 2, 4, 8)
        for vectors in (1, 2)
        for prefetch in (False, True)
    ]
    # Keep the split-K of the heuristic where it split (small N).
    grid = [cfg._replace(split_k=base.split_k) if not base.use_dot else cfg for cfg in grid]
    if base.use_dot and kind == "bf16":
        grid = dot_grid(k, base.split_k)  # FMA at 3+ rows costs 4.6+ instructions per weight byte
    configs, seen = [base], {base}
    for cfg in grid + sweep_configs(m, n, k, kind, num_sms)[1:]:
        if cfg not in seen and valid(cfg, k, kind, m) and cfg.block_k <= max(vec * 32, 1 << (k - 1).bit_length()):
            seen.add(cfg)
            configs.append(cfg)
    return configs


def dot_grid(k: int, split_k: int) -> list[Config]:
    """--wide, 16-bit weights on DOT: weight columns per program and warp (8 or more per warp,
    the MMA's N), K step and pipeline depth, within ~200 KiB of shared memory for the staged
    x and weight tiles; split-K as the heuristic's and, where it splits, also 1 and twice it."""
    configs = []
    splits = (split_k,) if split_k == 1 else (split_k, 1, 2 * split_k)
    for block_n in (16, 32, 64, 128):
        for warps in (2, 4, 8):
            for block_k in (64, 128, 256):
                for stages in (2, 3, 4, 5):
                    staged = stages * (16 + block_n) * block_k * 2
                    if block_n >= 8 * warps and staged <= 200 << 10 and block_k <= max(16, 1 << (k - 1).bit_length()):
                        configs += [Config(block_n, block_k, warps, stages, True, split) for split in splits]
    return configs


def plan(
    quick: bool,
    num_sms: int = NUM_SMS_H200,
    wide: bool = False,
    shapes: list[str] | None = None,
    batches: list[int] | None = None,
    kinds: list[str] | None = None,
) -> list[tuple[str, int, str, list[Config]]]:
    cases = []
    for name in shapes or (QUICK_SHAPES if quick else SHAPES):
        if name in DUPLICATE_SHAPES:
            continue
        n, k = SHAPES[name]
        for m in batches or (QUICK_BATCHES if quick else BATCHES):
            for kind in kinds or KINDS:
                configs = wide_configs(m, n, k, kind, num_sms) if wide else sweep_configs(m, n, k, kind, num_sms, quick)
                cases.append((name, m, kind, configs))
    return cases


def config_str(cfg: Config) -> str:
    path = "dot" if cfg.use_dot else "fma"
    prefetch = " pf" if cfg.prefetch else ""
    return f"{path} n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} split{cfg.split_k}{prefetch}"


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


def bench_case(name, m, kind, configs, bandwidth, replays, gen, cublas_cache, pdl_ab: bool) -> dict:
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

    pdl = gemv_fast.pdl_enabled(x)
    variants = [(i, cfg, pdl) for i, cfg in enumerate(configs)]
    if pdl_ab and pdl:
        variants.insert(1, (0, configs[0], False))  # the heuristic's config without PDL
    for i, cfg, use_pdl in variants:
        impl = ("triton_default" if i == 0 else "triton") + ("" if use_pdl == pdl else "_no_pdl")
        previous = os.environ.get("NINFER_PDL")
        os.environ["NINFER_PDL"] = "1" if use_pdl else "0"
        try:
            out = gemv_fast.gemv(x, weight, scale, config=cfg)
            if not matches(out, expected):
                record(impl, cfg, None, "wrong output: skipped")
                continue
            calls = [
                (lambda w=w, s=s: gemv_fast.gemv(x, w, s, config=cfg)) for w, s in (weights * num_calls)[:num_calls]
            ]
            record(impl, cfg, median_call_seconds(calls, replays), "pdl" if use_pdl else "")
        except Exception as exc:  # noqa: BLE001 - a config too big for shared memory / registers
            record(impl, cfg, None, f"{type(exc).__name__}: {str(exc)[:80]}")
        finally:
            if previous is None:
                del os.environ["NINFER_PDL"]
            else:
                os.environ["NINFER_PDL"] = previous

    # Baselines. cuBLAS bf16 once per (shape, M) (KINDS starts with bf16), shared by the
    # FP8 rows as the reference point for their speed-up.
    if kind == "bf16":
        calls = [(lambda w=w: torch.nn.functional.linear(x, w)) for w, _ in (weights * num_calls)[:num_calls]]
        cublas_cache[(name, m)] = median_call_seconds(calls, replays)
        record("cublas_linear_bf16", None, cublas_cache[(name, m)])
    else:
        padded_rows = -(-m // 16) * 16  # _scaled_mm takes row counts in multiples of 16
        x8 = torch.zeros(padded_rows, k, device="cuda", dtype=FP8)
        x8[:m] = x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)
        x_scale = torch.ones(padded_rows, 1, device="cuda")
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

    timed = [r for r in rows if r["impl"] in ("triton", "triton_default") and r["us"] is not None]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    default = next((r for r in timed if r["impl"] == "triton_default"), None)
    no_pdl = next((r for r in rows if r["impl"] == "triton_default_no_pdl" and r["us"] is not None), None)
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
        "pdl": pdl,
        "default_no_pdl_us": None if no_pdl is None else no_pdl["us"],
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


def _compile_worker(tasks: list[tuple[int, int, int, str, tuple, bool]]) -> int:
    """Compile (and launch once, on uninitialised weights) each task's kernel variant:
    fills Triton's on-disk cache so the timed process only loads cubins."""
    shapes: dict = {}
    for n, k, m, kind, cfg, pdl in tasks:
        if (n, k, kind) not in shapes:
            shapes.clear()
            w = torch.empty(n, k, device="cuda", dtype=weight_dtype(kind))
            s = None if kind == "bf16" else (
                torch.ones(n, device="cuda") if kind == "fp8_channel" else torch.ones(-(-n // 128), -(-k // 128), device="cuda")
            )
            shapes[(n, k, kind)] = (w, s)
        w, s = shapes[(n, k, kind)]
        os.environ["NINFER_PDL"] = "1" if pdl else "0"
        try:
            gemv_fast.gemv(torch.zeros(m, k, device="cuda", dtype=torch.bfloat16), w, s, config=Config(*cfg))
        except Exception:  # noqa: BLE001 - reported by the timed run
            pass
    torch.cuda.synchronize()
    return len(tasks)


def timed_variants(cases, pdl: bool, pdl_ab: bool) -> list[tuple[str, int, str, Config, bool]]:
    """(shape, M, kind, config, PDL) for every timing: the heuristic's config also without PDL."""
    out = []
    for name, m, kind, cfgs in cases:
        for i, cfg in enumerate(cfgs):
            out.append((name, m, kind, cfg, pdl))
            if i == 0 and pdl and pdl_ab:
                out.append((name, m, kind, cfg, False))
    return out


def kernel_variant(m: int, kind: str, cfg: Config, pdl: bool) -> tuple:
    """What Triton compiles separately (the real shapes all divide by 16 and by block_k)."""
    block_m = gemv_fast._block_m(m, cfg.use_dot, kind != "bf16")
    return (kind, cfg._replace(split_k=min(cfg.split_k, 2)), block_m, m == block_m and cfg.use_dot, pdl)


def precompile(variants, workers: int) -> None:
    """Triton compiles one variant at a time (~1-3 s each): spread the compiles over worker
    processes first."""
    import multiprocessing as mp

    tasks = {(*SHAPES[name], m, kind, tuple(cfg), pdl) for name, m, kind, cfg, pdl in variants}
    # Sorted by variant, in contiguous slices: one variant's tasks (which differ only in
    # shape) mostly land on one worker and compile once.
    tasks = sorted(tasks, key=lambda t: (t[3], t[4], t[5], t[2], t[1], t[0]))
    size = -(-len(tasks) // workers)
    chunks = [tasks[i : i + size] for i in range(0, len(tasks), size)]
    with mp.get_context("spawn").Pool(len(chunks)) as pool:
        pool.map(_compile_worker, chunks)


def estimate_seconds(cases, variants, workers: int) -> float:
    """Rough wall time on an H200: compiles (~2.5 s per kernel variant, spread over the
    workers), and per timing (warm-up, capture, 3 + replays) the graph's weight bytes at
    ~75 % of bandwidth plus ~25 ms of fixed costs, plus ~60 ms per case for its weights."""
    kernels = {kernel_variant(m, kind, cfg, pdl) for _, m, kind, cfg, pdl in variants}
    compile_s = 10 + 2.5 * len(kernels) / max(1, workers)
    seconds = compile_s + 0.06 * len(cases)
    for name, m, kind, cfg, pdl in variants:
        n, k = SHAPES[name]
        weight_bytes = n * k * (2 if kind == "bf16" else 1)
        calls = max(MIN_CALLS, math.ceil(L2_FLUSH_BYTES / weight_bytes))
        seconds += 0.025 + 15 * calls * weight_bytes / (0.75 * H200_BYTES_PER_S)
    baselines = {(name, m, kind) for name, m, kind, _, _ in variants}
    for name, m, kind in baselines:
        n, k = SHAPES[name]
        weight_bytes = n * k * (2 if kind == "bf16" else 1)
        calls = max(MIN_CALLS, math.ceil(L2_FLUSH_BYTES / weight_bytes))
        seconds += 0.025 + 15 * calls * weight_bytes / (0.75 * H200_BYTES_PER_S)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write results here (JSON)")
    quick_help = f"{len(QUICK_SHAPES)} shapes, every M, {QUICK_ALTERNATIVES} alternatives: ~90 s"
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--plan", action="store_true", help="print cases, configs, a time estimate; no GPU needed")
    parser.add_argument("--no-pdl", action="store_true", help="launch without PDL throughout (NINFER_PDL=0)")
    parser.add_argument("--compile-workers", type=int, default=12, help="pre-compiling processes (0: none)")
    parser.add_argument("--wide", action="store_true", help="every FMA tile (see wide_configs), not just neighbours")
    parser.add_argument("--shapes", help=f"comma-separated subset of {', '.join(SHAPES)}")
    parser.add_argument("--batches", help="comma-separated M values")
    parser.add_argument("--kinds", help=f"comma-separated subset of {', '.join(KINDS)}")
    args = parser.parse_args()
    selection = dict(
        wide=args.wide,
        shapes=args.shapes.split(",") if args.shapes else None,
        batches=[int(m) for m in args.batches.split(",")] if args.batches else None,
        kinds=args.kinds.split(",") if args.kinds else None,
    )
    unknown = [name for name in selection["shapes"] or [] if name not in SHAPES]
    unknown += [kind for kind in selection["kinds"] or [] if kind not in KINDS]
    if unknown:
        parser.error(f"unknown shape or kind: {', '.join(unknown)}")
    if args.no_pdl:
        os.environ["NINFER_PDL"] = "0"
    pdl_wanted = os.environ.get("NINFER_PDL", "1") != "0"
    if args.plan:
        cases = plan(args.quick, **selection)
        variants = timed_variants(cases, pdl_wanted, pdl_ab=True)
        for name, m, kind, cfgs in cases:
            print(name, m, kind, "; ".join(config_str(c) for c in cfgs))
        kernels = {kernel_variant(m, kind, cfg, pdl) for _, m, kind, cfg, pdl in variants}
        pdl_note = "the heuristic's config with PDL on and off" if pdl_wanted else "PDL off"
        seconds = estimate_seconds(cases, variants, args.compile_workers)
        print(
            f"{len(cases)} cases, {len(variants)} timings of our kernel ({pdl_note}), "
            f"~{len(kernels)} kernel variants; ~{seconds:.0f} s on an H200 (estimate)"
        )
        return
    started = time.time()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = plan(args.quick, num_sms, **selection)
    pdl = gemv_fast.pdl_enabled(torch.empty(1, device="cuda"))
    variants = timed_variants(cases, pdl, pdl_ab=True)
    if args.compile_workers > 0:
        precompile(variants, args.compile_workers)
        print(f"compiled the plan's kernels in {time.time() - started:.0f} s ({args.compile_workers} processes)")
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} ({num_sms} SMs): copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    print(
        f"Each timing: a CUDA graph of >= {MIN_CALLS} back-to-back calls in one stream (same x, rotating weight "
        f"copies, no data dependence); PDL {'on (the heuristic config also timed with it off)' if pdl else 'off'}"
    )
    replays = 10
    gen = torch.Generator("cuda").manual_seed(0)
    cublas_cache: dict = {}
    results = []
    for name, m, kind, configs in cases:
        results.append(bench_case(name, m, kind, configs, bandwidth, replays, gen, cublas_cache, pdl_ab=True))
        torch.cuda.empty_cache()
    summaries = [r["summary"] for r in results]

    fmt = lambda v, spec: "-" if v is None or v != v else format(v, spec)  # noqa: E731
    print("\nPer case, us per call: the heuristic's pick (PDL on / off), the best config, cuBLAS bf16, _scaled_mm")
    print("(* = the pick was the best; bw = fraction of copy bandwidth; vs = pick / baseline, < 1 is faster)")
    print(
        f"{'shape':18} {'M':>2} {'kind':11} {'pick':30} {'us':>8} {'no-pdl':>8} {'best':30} {'us':>8} {'bw':>6} "
        f"{'cuBLAS':>8} {'vs':>5} {'scaled':>8} {'vs':>5}"
    )
    for s in summaries:
        pick = config_str(Config(**s["default_config"]))
        best = "-" if s["best_config"] is None else config_str(Config(**s["best_config"]))
        us = s["default_us"]
        vs_cublas = None if us is None else us / s["cublas_bf16_us"]
        vs_scaled = None if us is None or s["scaled_mm_us"] is None else us / s["scaled_mm_us"]
        star = "*" if s["heuristic_is_best"] else " "
        print(
            f"{s['shape']:18} {s['m']:>2} {s['kind']:11} {pick:30} {fmt(us, '8.2f')} "
            f"{fmt(s['default_no_pdl_us'], '8.2f')} {best:30}{star}{fmt(s['best_us'], '7.2f')} "
            f"{fmt(s['best_fraction_of_copy_bw'], '6.1%')} {fmt(s['cublas_bf16_us'], '8.2f')} {fmt(vs_cublas, '5.2f')} "
            f"{fmt(s['scaled_mm_us'], '8.2f')} {fmt(vs_scaled, '5.2f')}"
        )
    picked = sum(s["heuristic_is_best"] for s in summaries)
    close = sum(s["default_within_5pct_of_best"] for s in summaries)
    pairs = [(s["default_us"], s["default_no_pdl_us"]) for s in summaries if s["default_us"] and s["default_no_pdl_us"]]
    elapsed = time.time() - started
    print(f"heuristic best in {picked}/{len(summaries)} cases, within 5 % in {close}; {elapsed:.0f} s")
    if pairs:
        saved = statistics.median(off - on for on, off in pairs)
        print(f"PDL: median saving {saved:.2f} us per call over {len(pairs)} cases (heuristic's config)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "num_sms": num_sms,
                    "copy_bandwidth": bandwidth,
                    "quick": args.quick,
                    "pdl": pdl,
                    "seconds": elapsed,
                    "summaries": summaries,
                    "rows": [row for r in results for row in r["rows"]],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
