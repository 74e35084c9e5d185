"""Gated DeltaNet decode-step microbenchmark: conv update + recurrent rule, vs bytes moved.

A decode step of one GDN layer must read and write every request's fp32 recurrent state
(B * Hv * dk * dv * 4 bytes each way) and its conv state; everything else (q, k, v, gates,
outputs) is a few KiB. The floor is those bytes over the copy bandwidth measured here in
the same run. Each timing replays a CUDA graph of NUM_LAYERS calls on NUM_LAYERS separate
state buffers (as the model's layers are), so states stream from HBM rather than L2, and
reports the median per call.

    python benchmarks/kernels/bench_gdn.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from ninfer.kernels.causal_conv1d import triton as conv_fast
from ninfer.kernels.gated_delta_rule import triton as gdn_fast
from timing import copy_bandwidth, median_seconds  # benchmarks/kernels/timing.py (run as a script)

SHAPES = {"27B": (16, 48), "35B-A3B": (16, 32)}  # (Hk, Hv); dk = dv = 128
HEAD_DIM = 128
NUM_LAYERS = 16
BATCHES = (1, 8)
# (BLOCK_V, num_warps) beside the default choice (None); the first run's sweep also had
# (16, 2), (32, 8), (64, 8), (128, 8), all slower (docs/kernels.md).
VARIANTS = ((None, 4), (16, 4), (32, 4), (64, 4))


def _fla_recurrent():
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return fused_recurrent_gated_delta_rule


def bench_shape(shape: str, batch: int, bandwidth: float) -> list[dict]:
    num_k_heads, num_v_heads = SHAPES[shape]
    key_dim, value_dim = num_k_heads * HEAD_DIM, num_v_heads * HEAD_DIM
    conv_dim = 2 * key_dim + value_dim
    num_slots = 2 * batch
    gen = torch.Generator("cuda").manual_seed(batch)
    states = [
        torch.randn(num_slots, num_v_heads, HEAD_DIM, HEAD_DIM, device="cuda", generator=gen) * 0.5
        for _ in range(NUM_LAYERS)
    ]
    conv_states = [
        torch.randn(num_slots, conv_dim, 3, device="cuda", generator=gen).bfloat16() for _ in range(NUM_LAYERS)
    ]
    weights = [torch.randn(conv_dim, 4, device="cuda", generator=gen).bfloat16() for _ in range(NUM_LAYERS)]
    slots = torch.randperm(num_slots, device="cuda", generator=gen)[:batch]
    qkv = torch.randn(batch, conv_dim, device="cuda", generator=gen).bfloat16()
    q = qkv[:, :key_dim].reshape(batch, num_k_heads, HEAD_DIM)
    k = qkv[:, key_dim : 2 * key_dim].reshape(batch, num_k_heads, HEAD_DIM)
    v = qkv[:, 2 * key_dim :].reshape(batch, num_v_heads, HEAD_DIM)
    g = -torch.rand(batch, num_v_heads, device="cuda", generator=gen)
    beta = torch.rand(batch, num_v_heads, device="cuda", generator=gen)
    lengths = (1,) * batch

    state_bytes = 2 * batch * num_v_heads * HEAD_DIM * HEAD_DIM * 4
    io_bytes = (2 * key_dim + 2 * value_dim) * batch * 2 + 2 * batch * num_v_heads * 4
    conv_bytes = 2 * batch * conv_dim * 3 * 2 + 2 * batch * conv_dim * 2 + conv_dim * 4 * 2
    rows = []

    def record(op: str, variant: str, seconds: float, num_bytes: int) -> None:
        rows.append(
            {
                "shape": shape,
                "batch": batch,
                "op": op,
                "variant": variant,
                "us": seconds * 1e6,
                "bytes": num_bytes,
                "floor_us": num_bytes / bandwidth * 1e6,
                "fraction_of_copy_bw": num_bytes / seconds / bandwidth,
            }
        )

    for block_v, warps in VARIANTS:

        def layers(block_v=block_v, warps=warps):
            for state in states:
                gdn_fast.recurrent_gated_delta_rule(
                    q, k, v, g, beta, state, slots, lengths, block_v=block_v, num_warps=warps
                )

        variant = (
            f"BV{block_v}/w{warps}"
            if block_v
            else f"default BV{gdn_fast._block_v(q.device, batch, num_v_heads, HEAD_DIM)}"
        )
        record("recurrent", variant, median_seconds(layers) / NUM_LAYERS, state_bytes + io_bytes)

    def conv_layers():
        for conv_state, weight in zip(conv_states, weights):
            conv_fast.causal_conv1d_update(qkv, weight, conv_state, slots)

    record("conv_update", "BC256", median_seconds(conv_layers) / NUM_LAYERS, conv_bytes)

    fla_recurrent = _fla_recurrent()
    if fla_recurrent is not None:
        # Peer: fla's fused recurrent kernel has no slot indirection, so gather + scatter the states.
        cu_seqlens = torch.arange(batch + 1, device="cuda")
        qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()

        def fla_layers():
            for state in states:
                _, final = fla_recurrent(
                    qc[None],
                    kc[None],
                    vc[None],
                    g[None],
                    beta[None],
                    initial_state=state[slots],
                    output_final_state=True,
                    use_qk_l2norm_in_kernel=True,
                    cu_seqlens=cu_seqlens,
                )
                state[slots] = final

        try:
            record(
                "fla_fused_recurrent+gather/scatter",
                "fla",
                median_seconds(fla_layers) / NUM_LAYERS,
                state_bytes + io_bytes,
            )
        except Exception as exc:  # noqa: BLE001 - the peer is informative only
            print(f"fla peer failed: {exc!r}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write all rows here")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    rows = []
    for shape in SHAPES:
        for batch in BATCHES:
            rows += bench_shape(shape, batch, bandwidth)
    print(f"{'shape':8} {'B':>2} {'op':36} {'variant':10} {'us':>8} {'floor us':>9} {'of copy bw':>10}")
    for r in rows:
        print(
            f"{r['shape']:8} {r['batch']:>2} {r['op']:36} {r['variant']:10} {r['us']:8.2f} "
            f"{r['floor_us']:9.2f} {r['fraction_of_copy_bw']:10.1%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth": bandwidth, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
