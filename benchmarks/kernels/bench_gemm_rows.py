"""bf16 matmul time against the row count around powers of two, at the 27B's projection shapes:
what a step graph's token bucket costs when it ends just past a power of two (1,032 = 1,024 + 8
decode rows) instead of at it. Each row count is timed as the step's Linear runs it
(F.linear on cuBLAS), CUDA-event median of graph-replayed calls; the last line sums one
layer of each kind over the 27B's 48 Gated DeltaNet and 16 attention layers.

    python3 benchmarks/kernels/bench_gemm_rows.py --out /tmp/gemm-rows.json [--rows 256,264,1024,1032]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere in the repo

from timing import median_seconds  # noqa: E402  benchmarks/kernels/timing.py

SHAPES = {  # (N, K) of the 27B's projections, and how many of the 64 layers have each
    "gdn_in_proj": ((16480, 5120), 48),
    "gdn_out_proj": ((5120, 6144), 48),
    "attn_qkv": ((14336, 5120), 16),
    "attn_o_proj": ((5120, 6144), 16),
    "mlp_gate_up": ((34816, 5120), 64),
    "mlp_down": ((5120, 17408), 64),
}
ROWS = (16, 24, 32, 40, 64, 72, 128, 136, 248, 256, 264, 512, 520, 1016, 1024, 1032, 2048, 2056)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", help=f"comma-separated row counts (default {','.join(map(str, ROWS))})")
    parser.add_argument("--replays", type=int, default=15)
    parser.add_argument("--out", help="write the table here (JSON)")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")] if args.rows else list(ROWS)
    times: dict[str, dict[int, float]] = {}
    gen = torch.Generator("cuda").manual_seed(0)
    for name, ((n, k), _) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * k**-0.5
        x = torch.randn(max(rows), k, device="cuda", generator=gen, dtype=torch.bfloat16)
        times[name] = {m: median_seconds(lambda m=m: F.linear(x[:m], weight), replays=args.replays) * 1e6 for m in rows}
    per_model = {m: sum(times[name][m] * layers for name, (_, layers) in SHAPES.items()) / 1e3 for m in rows}
    print(f"{torch.cuda.get_device_name()}: µs per product (CUDA-event median), by rows")
    print("shape".ljust(14) + "".join(f"{m:>9}" for m in rows))
    for name in SHAPES:
        print(name.ljust(14) + "".join(f"{times[name][m]:9.1f}" for m in rows))
    print("27B, ms".ljust(14) + "".join(f"{per_model[m]:9.2f}" for m in rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "us": times, "model_ms": per_model}, indent=1))


if __name__ == "__main__":
    main()
