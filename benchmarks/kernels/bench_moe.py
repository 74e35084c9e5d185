"""Routed-MoE decode microbenchmark (35B-A3B: 256 experts, top-8, hidden 2048, expert 512).

A decode step must read each selected expert's gate/up and down weights once:
unique_experts * 3 * H * I * 2 bytes (bf16); activations are a few KiB. The floor is those
bytes over the copy bandwidth measured here in the same run. Each timing replays a CUDA
graph of NUM_CALLS router + expert calls, each with its own random routing over one
layer's 1.5 GiB of experts, so the weights come from HBM rather than L2; the median per
call is reported. Decode tile variants and router widths are timed side by side; prefills
of 1000 and 4096 tokens (the sorted, grouped path) at each BLOCK_M are reported in TFLOP/s
and as the fraction of copy bandwidth that reading each hit expert's weights once would take.

    python benchmarks/kernels/bench_moe.py [--json OUT.json]

--block times the whole decode block as a layer runs it (router GEMV, choice, experts, shared
expert, its gate, the sum) on the separate ops against the router GEMV + the fused block
(kernels/moe_block, two launches), with its tile variants, at 1-8 tokens (the layers take it up
to 4): bf16 weights, then FP8, then NVFP4 (experts and shared expert; router and gate bf16).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from ninfer.kernels.activation import sigmoid_mul, silu_and_mul
from ninfer.kernels.gemv import gemv, gemv_silu_and_mul, linear
from ninfer.kernels.gemv.ref import quantize_blocks
from ninfer.kernels.moe import triton as moe_fast
from ninfer.kernels.moe.ref import quantize_nvfp4_experts  # noqa: E402
from ninfer.kernels.moe_block import triton as block_fast
from ninfer.kernels.nvfp4_gemv import gemv_nvfp4
from timing import copy_bandwidth, median_seconds  # benchmarks/kernels/timing.py (run as a script)

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 256, 8, 2048, 512
NUM_CALLS = 16
BATCHES = (1, 2, 4, 8)
# Alternatives timed beside the default TILES entry: (up, down) overrides, None = default.
UP_VARIANTS = ((32, 128, 4, 4), (64, 128, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3))
DOWN_VARIANTS = ((32, 128, 4, 4), (64, 128, 4, 3), (128, 64, 4, 4))
ROUTE_WARPS = (1, 2, 4)
PREFILL_TOKENS = (1000, 4096)
PREFILL_BLOCK_M = (16, 32, 64)
# --prefill-sweep: 8192 tokens (256 rows per expert on average, the 35B-A3B 8K prefill chunk).
# (block_m, up tile or None = default, down tile or None); tiles are (BLOCK_N, BLOCK_K, warps, stages).
SWEEP_TOKENS = 8192
# The best Triton tiles at BLOCK_M 64 and 128 in the first --prefill-sweep run on an H200
# (2026-12-01; docs/kernels.md, "Routed MoE").
SWEEP_TRITON = ((64, (64, 64, 4, 3), (128, 64, 8, 3)), (128, (64, 64, 4, 3), (128, 64, 4, 3)))


def bench_batch(batch: int, gate_up: torch.Tensor, down: torch.Tensor, bandwidth: float, gen: torch.Generator):
    x = torch.randn(batch, HIDDEN, device="cuda", generator=gen).bfloat16()
    # Router logits per call; their top-8 picks NUM_CALLS independent random expert sets.
    logits = [torch.randn(batch, NUM_EXPERTS, device="cuda", generator=gen).bfloat16() for _ in range(NUM_CALLS)]
    routes = [moe_fast.route(lg, TOP_K, True) for lg in logits]
    unique = sum(torch.unique(ids).numel() for _, ids in routes) / NUM_CALLS
    num_bytes = int(unique * 3 * HIDDEN * INTER * 2)
    rows = []

    def record(op: str, variant: str, seconds: float, nbytes: int) -> None:
        rows.append(
            {
                "batch": batch,
                "op": op,
                "variant": variant,
                "unique_experts": unique,
                "us": seconds * 1e6,
                "bytes": nbytes,
                "floor_us": nbytes / bandwidth * 1e6,
                "fraction_of_copy_bw": nbytes / seconds / bandwidth,
            }
        )

    for warps in ROUTE_WARPS:

        def route_calls(warps=warps):
            for lg in logits:
                moe_fast.route(lg, TOP_K, True, num_warps=warps)

        record("route", f"w{warps}", median_seconds(route_calls) / NUM_CALLS, batch * NUM_EXPERTS * 2)

    default_up, default_down = moe_fast.TILES[min(64, max(16, 1 << (batch * TOP_K - 1).bit_length()))]
    configs = [(None, None)] + [(up, default_down) for up in UP_VARIANTS if up != default_up]
    configs += [(default_up, dn) for dn in DOWN_VARIANTS if dn != default_down]
    for up, dn in configs:

        def expert_calls(up=up, dn=dn):
            for weights, ids in routes:
                moe_fast.fused_experts(x, weights, ids, gate_up, down, tiles=None if up is None else (up, dn))

        if up is None:
            variant = "default up" + "/".join(map(str, default_up)) + " dn" + "/".join(map(str, default_down))
        else:
            variant = "up" + "/".join(map(str, up)) + " dn" + "/".join(map(str, dn))
        try:
            record("experts", variant, median_seconds(expert_calls) / NUM_CALLS, num_bytes)
        except triton.runtime.errors.OutOfResources as exc:  # a variant too big for shared memory
            print(f"B={batch} {variant}: {exc}")

    def step_calls():
        for lg in logits:
            weights, ids = moe_fast.route(lg, TOP_K, True)
            moe_fast.fused_experts(x, weights, ids, gate_up, down)

    record("route+experts", "default", median_seconds(step_calls) / NUM_CALLS, num_bytes)
    return rows


# (up, down) tiles of the fused block timed beside the default: (BLOCK_N, BLOCK_K, warps), and
# for down optionally its splits over the slots
BLOCK_VARIANTS = (
    ((8, 256, 1), (16, 256, 4, 9)),
    ((8, 256, 1), (16, 256, 4)),
    ((16, 512, 4), (16, 512, 4)),
    ((8, 256, 1), (16, 256, 4, 3)),
    ((8, 512, 1), (16, 256, 4, 9)),
    ((4, 256, 1), (16, 256, 4, 9)),
    ((8, 256, 2), (16, 256, 4, 9)),
    ((8, 256, 1), (8, 256, 2, 9)),
    ((8, 256, 1), (16, 512, 4, 9)),
)
# The same for NVFP4 weights, BLOCK_K in codes (16 bytes, 32 codes, a thread's vector): the down
# projection's K is 512 codes (one step at 512), the up one's 2048.
NVFP4_BLOCK_VARIANTS = (
    ((8, 1024, 1), (16, 512, 4, 9)),
    ((8, 512, 1), (16, 512, 4, 9)),
    ((2, 1024, 1), (16, 512, 4, 9)),
    ((4, 512, 1), (16, 512, 4, 9)),
    ((4, 2048, 1), (16, 512, 4, 9)),
    ((4, 1024, 1), (8, 512, 2, 9)),
    ((4, 1024, 1), (16, 512, 4, 3)),
)


def bench_block(batch: int, gate_up, down, bandwidth: float, gen: torch.Generator, quant: str | None = None) -> list[dict]:
    """One layer's MoE block at decode sizes: separate ops against the fused block. quant "fp8":
    experts in 128 x 128 blocks (Qwen's FP8 checkpoints), the shared expert in row blocks
    (Fp8Linear's layout for them); "nvfp4": experts and shared expert NVFP4 (ModelOpt's layout,
    quantized per expert, gate_up and down given as (codes, (block_scale, row_scale))); router
    and shared gate bf16."""
    x = torch.randn(batch, HIDDEN, device="cuda", generator=gen).bfloat16()

    def randn(*shape):
        return (torch.randn(*shape, device="cuda", generator=gen) * shape[-1] ** -0.5).bfloat16()

    # One router per call: its choices differ call to call, so experts come from HBM.
    routers = [randn(NUM_EXPERTS, HIDDEN) for _ in range(NUM_CALLS)]
    shared_gate_up, shared_down, shared_gate = randn(2 * INTER, HIDDEN), randn(HIDDEN, INTER), randn(1, HIDDEN)
    scales = [None] * 4
    if quant == "fp8":
        (gate_up, scales[0]), (down, scales[1]) = quantize_blocks(gate_up, 128), quantize_blocks(down, 128)
        (shared_gate_up, scales[2]), (shared_down, scales[3]) = quantize_blocks(shared_gate_up, 1), quantize_blocks(shared_down, 1)
    elif quant == "nvfp4":
        (gate_up, scales[0]), (down, scales[1]) = quantize_nvfp4_experts(gate_up), quantize_nvfp4_experts(down)
        (shared_gate_up, scales[2]), (shared_down, scales[3]) = quantize_nvfp4_experts(shared_gate_up), quantize_nvfp4_experts(shared_down)
    unique = sum(torch.unique(moe_fast.route(linear(x, r), TOP_K, True)[1]).numel() for r in routers) / NUM_CALLS
    if quant == "nvfp4":
        # codes (half a byte a weight), an e4m3 scale per 16 weights and an fp32 scale per row
        expert_bytes = 3 * HIDDEN * INTER * (0.5 + 1 / 16) + (2 * INTER + HIDDEN) * 4
    else:
        expert_bytes = 3 * HIDDEN * INTER * (1 if quant == "fp8" else 2)
    num_bytes = int((unique + 1) * expert_bytes + (NUM_EXPERTS + 1) * HIDDEN * 2)
    rows = []

    def record(variant: str, seconds: float) -> None:
        rows.append({"batch": batch, "op": "moe block" + (f" {quant}" if quant else ""), "variant": variant,
                     "unique_experts": unique, "us": seconds * 1e6, "bytes": num_bytes,
                     "floor_us": num_bytes / bandwidth * 1e6, "fraction_of_copy_bw": num_bytes / seconds / bandwidth})  # fmt: skip

    def shared_expert():
        if quant == "nvfp4":  # Nvfp4Linear's products, then the activation on its own
            return gemv_nvfp4(silu_and_mul(gemv_nvfp4(x, shared_gate_up, *scales[2])), shared_down, *scales[3])
        return gemv(gemv_silu_and_mul(x, shared_gate_up, scales[2]), shared_down, scales[3])

    def separate_ops():
        for router in routers:
            weights, ids = moe_fast.route(linear(x, router), TOP_K, True)
            out = moe_fast.fused_experts(x, weights, ids, gate_up, down, scales[0], scales[1])
            out + sigmoid_mul(shared_expert(), linear(x, shared_gate))

    record(f"separate ops ({12 if quant == 'nvfp4' else 11} launches)", median_seconds(separate_ops) / NUM_CALLS)
    default = block_fast.TILES[{"fp8": 1, "nvfp4": 0.5}.get(quant, 2)]
    for tiles in NVFP4_BLOCK_VARIANTS if quant == "nvfp4" else BLOCK_VARIANTS:

        def fused(tiles=tiles):
            for router in routers:
                block_fast.moe_block(x, linear(x, router), TOP_K, True, gate_up, down, shared_gate_up, shared_down,
                                     shared_gate, *scales, tiles=tiles)  # fmt: skip

        name = "fused up" + "/".join(map(str, tiles[0])) + " dn" + "/".join(map(str, tiles[1]))
        record(name + (" (default)" if tiles == default else ""), median_seconds(fused) / NUM_CALLS)
    return rows


def prefill_sweep(gate_up: torch.Tensor, down: torch.Tensor, gen: torch.Generator) -> list[dict]:
    """8192-token prefill: the Triton grouped kernels (best tiles of the first sweep) and the
    torch grouped GEMM path, the stages of the default split out by the profiler, and a cuBLAS
    bound: torch.bmm over the same FLOPs in 256 equal groups (a perfectly balanced grouped GEMM)."""
    tokens = SWEEP_TOKENS
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    weights, ids = moe_fast.route(torch.randn(tokens, NUM_EXPERTS, device="cuda", generator=gen), TOP_K, True)
    flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
    rows = []

    def record(variant: str, seconds: float) -> None:
        rows.append({"tokens": tokens, "variant": variant, "us": seconds * 1e6, "tflops": flops / seconds / 1e12})
        print(f"prefill {tokens} {variant:44} {seconds * 1e6:8.0f} us {flops / seconds / 1e12:6.0f} TFLOP/s", flush=True)

    per_group = tokens * TOP_K // NUM_EXPERTS
    xs = torch.randn(NUM_EXPERTS, per_group, HIDDEN, device="cuda", generator=gen).bfloat16()
    acts = torch.randn(NUM_EXPERTS, per_group, INTER, device="cuda", generator=gen).bfloat16()
    record("torch.bmm, 256 equal groups (cuBLAS)", median_seconds(
        lambda: (torch.bmm(xs, gate_up.transpose(1, 2)), torch.bmm(acts, down.transpose(1, 2))), replays=10, graph=False))
    for block_m, up, dn in SWEEP_TRITON:
        name = f"Triton BLOCK_M {block_m} up" + "/".join(map(str, up)) + " dn" + "/".join(map(str, dn))
        record(name, median_seconds(
            lambda up=up, dn=dn, block_m=block_m: moe_fast.fused_experts(
                x, weights, ids, gate_up, down, block_m=block_m, tiles=(up, dn), grouped_mm=False),
            replays=10, graph=False))
    record("torch grouped_mm (the default on sm_90)", median_seconds(
        lambda: moe_fast.fused_experts(x, weights, ids, gate_up, down, grouped_mm=True), replays=10, graph=False))
    # FP8 experts (128 x 128 blocks, Qwen's checkpoints): the Triton kernels on e4m3 tiles, and
    # every expert dequantized to bf16 for the grouped GEMM (the default from FP8_GROUPED_MM_MIN_PAIRS).
    (fp8_gate_up, gate_up_scale), (fp8_down, down_scale) = quantize_blocks(gate_up, 128), quantize_blocks(down, 128)
    fp8 = (fp8_gate_up, fp8_down, gate_up_scale, down_scale)
    record("FP8 Triton kernels on e4m3 tiles", median_seconds(
        lambda: moe_fast.fused_experts(x, weights, ids, *fp8, grouped_mm=False), replays=10, graph=False))
    record("FP8 dequantized + torch grouped_mm", median_seconds(
        lambda: moe_fast.fused_experts(x, weights, ids, *fp8, grouped_mm=True), replays=10, graph=False))
    # FP8 experts with one scale per output row (--quantize fp8's layout): dequantized for the bf16
    # grouped GEMM, and on FP8 operands through torch's scaled grouped GEMM (kernels/moe/scaled_grouped.py).
    per_row = []
    for w in (gate_up, down):
        scale = (w.float().abs().amax(dim=-1) / 448.0).clamp(min=1e-12)
        per_row.append(((w.float() / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale))
    fp8_rows = (per_row[0][0], per_row[1][0], per_row[0][1], per_row[1][1])
    from ninfer.kernels.moe import scaled_grouped

    scaled_ok = scaled_grouped.supported(x.device)
    print("torch's scaled grouped GEMM computes the FP8 experts right here:", scaled_ok, flush=True)
    record("FP8 per-row scales, dequantized + grouped_mm", median_seconds(
        lambda: moe_fast.fused_experts(x, weights, ids, *fp8_rows, grouped_mm=True, fp8_grouped=False), replays=10, graph=False))
    if scaled_ok:  # else fused_experts would time the dequantized route under this name
        record("FP8 per-row scales, scaled grouped GEMM", median_seconds(
            lambda: moe_fast.fused_experts(x, weights, ids, *fp8_rows, grouped_mm=True, fp8_grouped=True), replays=10, graph=False))
    record("FP8 dequantization alone (both)", median_seconds(
        lambda: (moe_fast.dequantize_experts(fp8_gate_up, gate_up_scale, torch.bfloat16),
                 moe_fast.dequantize_experts(fp8_down, down_scale, torch.bfloat16)), replays=10, graph=False))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            moe_fast.fused_experts(x, weights, ids, gate_up, down)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write all rows here")
    parser.add_argument("--prefill-sweep", action="store_true", help="only the 8192-token prefill tile sweep")
    parser.add_argument("--block", action="store_true", help="only the whole decode block: separate ops vs fused")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    gen = torch.Generator("cuda").manual_seed(0)
    gate_up = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5).bfloat16()
    down = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) * INTER**-0.5).bfloat16()
    if args.prefill_sweep:
        sweep = prefill_sweep(gate_up, down, gen)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"copy_bandwidth": bandwidth, "prefill_sweep": sweep}, f, indent=1)
        return
    if args.block:
        rows = [row for quant in (None, "fp8", "nvfp4") for batch in (1, 2, 4, 8)
                for row in bench_block(batch, gate_up, down, bandwidth, gen, quant)]  # fmt: skip
        print(f"{'B':>2} {'op':15} {'variant':44} {'uniq':>5} {'us':>8} {'floor us':>9} {'of copy bw':>10}")
        for r in rows:
            print(f"{r['batch']:>2} {r['op']:15} {r['variant']:44} {r['unique_experts']:5.1f} {r['us']:8.2f} {r['floor_us']:9.2f} "
                  f"{r['fraction_of_copy_bw']:10.1%}")  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"copy_bandwidth": bandwidth, "block": rows}, f, indent=1)
        return
    rows = []
    for batch in BATCHES:
        rows += bench_batch(batch, gate_up, down, bandwidth, gen)

    # Prefill through the sorted grouped path. At 31 (1000 tokens) to 128 (4096) rows per expert
    # it reads every expert's weights once per BLOCK_M block, so report both bytes and FLOPs.
    prefill = []
    for tokens in PREFILL_TOKENS:
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
        weights, ids = moe_fast.route(torch.randn(tokens, NUM_EXPERTS, device="cuda", generator=gen), TOP_K, True)
        unique = torch.unique(ids).numel()
        flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
        for block_m in PREFILL_BLOCK_M:
            seconds = median_seconds(
                lambda x=x, weights=weights, ids=ids, block_m=block_m: moe_fast.fused_experts(
                    x, weights, ids, gate_up, down, block_m=block_m
                ),
                replays=10,
                graph=False,
            )
            num_bytes = unique * 3 * HIDDEN * INTER * 2
            prefill.append(
                {
                    "tokens": tokens,
                    "block_m": block_m,
                    "us": seconds * 1e6,
                    "tflops": flops / seconds / 1e12,
                    "weight_bytes": num_bytes,
                    "fraction_of_copy_bw": num_bytes / seconds / bandwidth,
                }
            )

    print(f"{'B':>2} {'op':14} {'variant':34} {'uniq':>5} {'us':>8} {'floor us':>9} {'of copy bw':>10}")
    for r in rows:
        print(
            f"{r['batch']:>2} {r['op']:14} {r['variant']:34} {r['unique_experts']:5.1f} {r['us']:8.2f} "
            f"{r['floor_us']:9.2f} {r['fraction_of_copy_bw']:10.1%}"
        )
    for p in prefill:
        print(
            f"prefill {p['tokens']:5} tokens BLOCK_M {p['block_m']:2}: {p['us']:7.0f} us, {p['tflops']:4.0f} TFLOP/s, "
            f"expert weights once = {p['fraction_of_copy_bw']:.0%} of copy bw"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth": bandwidth, "rows": rows, "prefill": prefill}, f, indent=1)


if __name__ == "__main__":
    main()
