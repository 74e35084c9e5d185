"""Per-layer small ops microbenchmark: our Triton RMSNorm / activation kernels vs the torch references.

Each op runs at the Qwen3.5 shapes (27B: hidden 5120, 24 q heads x 256, 48 GDN v heads x 128,
MLP intermediate 17408; 35B-A3B: hidden 2048) for 1, 8 and 1000 tokens. A timing replays a
CUDA graph of NUM_CALLS calls (what decode does; the references are captured the same way,
so their ~8 launches per norm are graph launches, not Python ones) and reports the median
per call in microseconds, and the bytes each call must move (inputs read once, outputs
written once) over that time in GB/s. At decode sizes the data sits in L2 and the numbers
measure launch + latency, not HBM bandwidth; at 1000 tokens they approach bandwidth.

    python benchmarks/kernels/bench_norm.py [--json OUT.json] [--eager]
"""

from __future__ import annotations

import argparse
import json

import torch

from ninfer.kernels.activation import ref as act_ref
from ninfer.kernels.activation import triton as act_fast
from ninfer.kernels.rms_norm import ref as norm_ref
from ninfer.kernels.rms_norm import triton as norm_fast
from timing import median_seconds  # benchmarks/kernels/timing.py (run as a script)

NUM_CALLS = 20
TOKENS = (1, 8, 1000)
EPS = 1e-6
HIDDEN = {"27B": 5120, "35B-A3B": 2048}
Q_HEADS, KV_HEADS, HEAD_DIM = 24, 4, 256  # 27B attention
GDN_HEADS, GDN_DIM = 48, 128  # 27B GatedDeltaNet
INTER = 17408  # 27B MLP
OPS = {  # name: (ours, the reference)
    "rms_norm": (norm_fast.rms_norm, norm_ref.rms_norm),
    "add_rms_norm": (norm_fast.add_rms_norm, norm_ref.add_rms_norm),
    "gated_rms_norm": (norm_fast.gated_rms_norm, norm_ref.gated_rms_norm),
    "silu_and_mul": (act_fast.silu_and_mul, act_ref.silu_and_mul),
    "sigmoid_mul": (act_fast.sigmoid_mul, act_ref.sigmoid_mul),
}


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def cases(num_tokens: int, gen: torch.Generator, device: str = "cuda"):
    """(op, shape, args, bytes moved) for every op at this token count."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen).bfloat16()

    for name, hidden in HIDDEN.items():
        x, residual, weight = randn(num_tokens, hidden), randn(num_tokens, hidden), randn(hidden)
        yield "rms_norm", name, (x, weight, EPS, True), nbytes(x, weight, x)
        yield "add_rms_norm", name, (x, residual, weight, EPS, True), nbytes(x, residual, weight, x, x)

    # q norm on the per-head view of the packed q|gate|k|v projection; its gate for sigmoid_mul.
    q_cols, kv_cols = Q_HEADS * 2 * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = randn(num_tokens, q_cols + 2 * kv_cols)
    q, gate = qkv[:, :q_cols].view(num_tokens, Q_HEADS, 2 * HEAD_DIM).chunk(2, dim=-1)
    attn, head_weight = randn(num_tokens, Q_HEADS, HEAD_DIM), randn(HEAD_DIM)
    yield "rms_norm", "27B q heads", (q, head_weight, EPS, True), nbytes(attn, head_weight, attn)
    yield "sigmoid_mul", "27B attn gate", (attn, gate), 3 * nbytes(attn)

    core, z, gdn_weight = randn(num_tokens, GDN_HEADS, GDN_DIM), randn(num_tokens, GDN_HEADS, GDN_DIM), randn(GDN_DIM)
    yield "gated_rms_norm", "27B GDN", (core, z, gdn_weight, EPS), nbytes(core, z, gdn_weight, core)

    gate_up = randn(num_tokens, 2 * INTER)
    yield "silu_and_mul", "27B MLP", (gate_up,), nbytes(gate_up) * 3 // 2

    shared, shared_gate = randn(num_tokens, HIDDEN["35B-A3B"]), randn(num_tokens, 1)
    yield "sigmoid_mul", "35B shared expert", (shared, shared_gate), nbytes(shared, shared_gate, shared)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write all rows here")
    parser.add_argument("--eager", action="store_true", help="time eager calls instead of graph replays")
    args = parser.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    for num_tokens in TOKENS:
        for op, shape, op_args, io_bytes in cases(num_tokens, gen):
            row = {"op": op, "shape": shape, "tokens": num_tokens, "bytes": io_bytes}
            for impl, fn in zip(("triton", "torch"), OPS[op]):

                def calls(fn=fn, op_args=op_args):
                    for _ in range(NUM_CALLS):
                        fn(*op_args)

                seconds = median_seconds(calls, replays=50, graph=not args.eager) / NUM_CALLS
                row[f"{impl}_us"] = seconds * 1e6
                row[f"{impl}_gb_s"] = io_bytes / seconds / 1e9
            row["speedup"] = row["torch_us"] / row["triton_us"]
            rows.append(row)

    mode = "eager" if args.eager else "graph-replayed"
    print(f"{torch.cuda.get_device_name()}, {mode}, median per call")
    print(f"{'op':15} {'shape':18} {'T':>5} {'triton us':>9} {'GB/s':>7} {'torch us':>9} {'GB/s':>7} {'speedup':>7}")
    for r in rows:
        print(
            f"{r['op']:15} {r['shape']:18} {r['tokens']:5} {r['triton_us']:9.2f} {r['triton_gb_s']:7.0f} "
            f"{r['torch_us']:9.2f} {r['torch_gb_s']:7.0f} {r['speedup']:6.1f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "mode": mode, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
