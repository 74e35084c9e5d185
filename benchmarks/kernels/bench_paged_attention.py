"""Decode paged attention: time per layer against the bytes of KV it must read.

    python benchmarks/kernels/bench_paged_attention.py [--out results.json] [--quick] [--verify]

For each shape (Qwen3.5-27B 24/4 x 256, Qwen3.5-35B-A3B 16/2 x 256, Llama-8B 32/8 x 128),
batch (1, 8) and context (4K, 128K): one decode step of one attention layer (q = 1 per
request), timed as the replay of a CUDA graph that runs L layers back to back, each layer
with its own KV pool so the L2 (60 MB on an H200) cannot serve repeats; time per layer =
median over replays / L. Reported against the floor bytes / copy bandwidth, the copy
bandwidth being a device-to-device copy measured in the same run (bytes read + written).

Baselines on the same data: torch SDPA on KV gathered from the pages each step (what a
framework without a paged kernel does) and SDPA on KV already contiguous (a dense-cache
lower bound for that library). Also: a sweep of the split count and block shapes of our
kernel (each variant checked against the default's output), and one prefill chunk per
block config (FLOP rate) next to SDPA's causal kernel.

--verify: speculative verification rows instead (the 27B's shape, K + 1 = 2, 4, 8 queries per
request at batch 1 and 8, 4K and 128K): each row count's default tile beside a sweep of
BLOCK_N x warps x stages, timed as above against the same KV floor (the queries share each
KV tile, so the floor does not grow with them).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ninfer.kernels.paged_attention import triton as kernels  # noqa: E402
from timing import copy_bandwidth, median_seconds  # noqa: E402  benchmarks/kernels/timing.py (run as a script)


def time_graph(fn, reps: int = 30) -> float:
    return median_seconds(fn, replays=reps)


def time_eager(fn, reps: int = 20) -> float:
    return median_seconds(fn, replays=reps, graph=False)

SHAPES = {"qwen3.5-27b": (24, 4, 256), "qwen3.5-35b-a3b": (16, 2, 256), "llama-8b": (32, 8, 128)}
PAGE_SIZE = 16
DTYPE = torch.bfloat16
L2_BYTES = 60 << 20


class Layers:
    """L independent KV pools (one per layer) with shuffled pages, and one query per request."""

    def __init__(self, shape: str, batch: int, context: int, num_layers: int, seed: int = 0, queries: int = 1):
        """queries: rows per request (a verification round's K + 1), the last `queries` positions."""
        num_heads, num_kv_heads, head_dim = SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(seed)
        pages = math.ceil(context / PAGE_SIZE)
        num_pages = batch * pages + 1
        self.q = torch.randn(batch * queries, num_heads, head_dim, generator=gen, device="cuda").to(DTYPE)
        self.caches = []
        for _ in range(num_layers):
            k = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, head_dim, generator=gen, device="cuda").to(DTYPE)
            v = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, head_dim, generator=gen, device="cuda").to(DTYPE)
            self.caches.append((k, v))
        order = torch.randperm(num_pages, generator=gen, device="cuda")[: batch * pages]
        self.page_table = order.view(batch, pages).int().contiguous()
        self.query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * queries
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.scale = head_dim**-0.5
        self.kv_bytes_per_layer = 2 * batch * context * num_kv_heads * head_dim * DTYPE.itemsize
        self.batch, self.context, self.shape, self.queries = batch, context, shape, queries

    def ours(self, **tuning):
        def run():
            for k, v in self.caches:
                kernels.paged_attention(
                    self.q, k, v, self.page_table, self.query_start_loc, self.seq_lens, self.scale,
                    max_query_len=self.queries, **tuning,
                )

        return run

    def one(self, **tuning) -> torch.Tensor:
        """Layer 0 once, outside any graph (the sweeps check each variant against the default)."""
        k, v = self.caches[0]
        return kernels.paged_attention(
            self.q, k, v, self.page_table, self.query_start_loc, self.seq_lens, self.scale,
            max_query_len=self.queries, **tuning,
        )

    def sdpa_gathered(self):
        """Gather each request's pages into a contiguous [B, Hk, S, D] tensor, then SDPA."""
        q = self.q.unsqueeze(2)  # [B, Hq, 1, D]

        def run():
            for k, v in self.caches:
                keys = k[self.page_table].flatten(1, 2)[:, : self.context].transpose(1, 2)
                values = v[self.page_table].flatten(1, 2)[:, : self.context].transpose(1, 2)
                F.scaled_dot_product_attention(q, keys, values, scale=self.scale, enable_gqa=True)

        return run

    def sdpa_contiguous(self):
        """SDPA on KV stored contiguously per request (no paging, no gather)."""
        q = self.q.unsqueeze(2)
        dense = [
            (k[self.page_table].flatten(1, 2)[:, : self.context].transpose(1, 2).contiguous(),
             v[self.page_table].flatten(1, 2)[:, : self.context].transpose(1, 2).contiguous())
            for k, v in self.caches[:2]
        ]

        def run():
            for keys, values in dense:
                F.scaled_dot_product_attention(q, keys, values, scale=self.scale, enable_gqa=True)

        return run, len(dense)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def sweep_variants(layers: Layers, variants: dict[str, dict]) -> dict[str, float | str]:
    """Each tuning variant's time per layer in µs, once its output matches the default's (else
    why not: a wrong result, or the launch's failure, e.g. out of shared memory)."""
    reference = layers.one()
    sweep: dict[str, float | str] = {}
    for key, tuning in variants.items():
        try:
            err = rel_err(layers.one(**tuning), reference)
            if not err < 2e-2:
                sweep[key] = f"WRONG: rel err {err:.3g}"
                continue
            sweep[key] = time_graph(layers.ours(**tuning), reps=15) / len(layers.caches) * 1e6
        except Exception as error:  # noqa: BLE001 - e.g. out of shared memory
            sweep[key] = f"failed: {type(error).__name__}"
    return sweep


def num_layers_for(bytes_per_layer: int) -> int:
    """Enough independent pools that one pass over them is 4x the L2 (16 at most, 2 at least)."""
    return max(2, min(16, math.ceil(4 * L2_BYTES / bytes_per_layer)))


def decode_cases(copy_bw: float, quick: bool, deadline: float) -> list[dict]:
    rows = []
    for shape in SHAPES:
        for batch in (1, 8):
            for context in (4096, 131072):
                if time.monotonic() > deadline:
                    return rows
                _, num_kv_heads, head_dim = SHAPES[shape]
                per_layer = 2 * batch * context * num_kv_heads * head_dim * DTYPE.itemsize
                layers = Layers(shape, batch, context, num_layers_for(per_layer))
                n = len(layers.caches)
                floor = per_layer / copy_bw
                default_splits, min_split = kernels.split_plan(batch, num_kv_heads, 1, 64, layers.q.device)
                entry = dict(shape=shape, batch=batch, context=context, kv_bytes=per_layer, floor_us=floor * 1e6,
                             default_splits=default_splits, min_split=min_split, layers=n)
                t = time_graph(layers.ours()) / n
                entry["ours_graph_us"] = t * 1e6
                entry["ours_fraction_of_copy_bw"] = floor / t
                entry["ours_eager_us"] = time_eager(layers.ours()) / n * 1e6
                entry["sdpa_gathered_us"] = time_graph(layers.sdpa_gathered()) / n * 1e6
                run, dense_n = layers.sdpa_contiguous()
                entry["sdpa_contiguous_us"] = time_graph(run) / dense_n * 1e6
                sweep = {}
                if shape != "llama-8b" and not quick:
                    variants = {f"splits={s}": dict(num_splits=s) for s in (16, 32, 64, 128, 256)}
                    variants.update({
                        f"block_n={bn},warps={w},stages={st}": dict(block_n=bn, num_warps=w, num_stages=st)
                        for bn, w, st in ((64, 4, 3), (32, 4, 2))
                    })
                    sweep = sweep_variants(layers, variants)
                entry["sweep_us"] = sweep
                rows.append(entry)
                print(
                    f"{shape:16s} B={batch} ctx={context:6d}: ours {entry['ours_graph_us']:8.1f} us "
                    f"({100 * entry['ours_fraction_of_copy_bw']:5.1f}% of copy bw; floor {entry['floor_us']:.1f}) "
                    f"eager {entry['ours_eager_us']:8.1f} | sdpa gathered {entry['sdpa_gathered_us']:8.1f} "
                    f"contiguous {entry['sdpa_contiguous_us']:8.1f} | splits {default_splits} min {min_split}",
                    flush=True,
                )
                if sweep:
                    print("    sweep:", ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in sweep.items()), flush=True)
                del layers
                torch.cuda.empty_cache()
    return rows


VERIFY_TILES = [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (1, 2)]


def verify_cases(copy_bw: float, deadline: float) -> list[dict]:
    """The 27B's attention over K + 1 verification rows per request: default tile and sweep."""
    rows = []
    shape = "qwen3.5-27b"
    _, num_kv_heads, head_dim = SHAPES[shape]
    for context in (131072, 4096):
        for batch in (1, 8):
            per_layer = 2 * batch * context * num_kv_heads * head_dim * DTYPE.itemsize
            for queries in (2, 4, 8):
                if time.monotonic() > deadline:
                    return rows
                layers = Layers(shape, batch, context, num_layers_for(per_layer), queries=queries)
                n = len(layers.caches)
                floor = per_layer / copy_bw
                entry = dict(shape=shape, batch=batch, context=context, queries=queries, floor_us=floor * 1e6, layers=n)
                entry["ours_graph_us"] = time_graph(layers.ours()) / n * 1e6
                sweep = sweep_variants(layers, {
                    f"block_n={bn},warps={w},stages={st}": dict(block_n=bn, num_warps=w, num_stages=st)
                    for bn, w, st in VERIFY_TILES
                })
                entry["sweep_us"] = sweep
                timed = {k: v for k, v in sweep.items() if isinstance(v, float)}
                best = min(timed, key=timed.get) if timed else None
                rows.append(entry)
                print(
                    f"verify B={batch} ctx={context:6d} q={queries}: default {entry['ours_graph_us']:8.1f} us "
                    f"({100 * floor * 1e6 / entry['ours_graph_us']:5.1f}% of copy bw; floor {floor * 1e6:.1f}) "
                    f"best {best} {timed.get(best, float('nan')):.1f}",
                    flush=True,
                )
                print("    sweep:", ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in sweep.items()), flush=True)
                del layers
                torch.cuda.empty_cache()
    return rows


PREFILL_CONFIGS = {  # (BLOCK_M, BLOCK_N, warps, stages): spill-free on sm_90 (cuobjdump), see docs/kernels.md
    256: [(64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2)],
    128: [(64, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3)],
}


def prefill_cases(query_len: int = 4096, context: int = 4096) -> list[dict]:
    """One chunk of query_len tokens over `context` cached tokens (+ itself): FLOP rate per
    block config, each checked against the default config's output; SDPA's causal kernel
    on a dense full sequence of the same total length for scale."""
    rows = [prefill_case(shape, query_len, context) for shape in ("qwen3.5-27b", "llama-8b")]
    torch.cuda.empty_cache()
    return rows


def prefill_case(shape: str, query_len: int, context: int) -> dict:
    num_heads, num_kv_heads, head_dim = SHAPES[shape]
    seq_len = context + query_len
    layers = Layers(shape, 1, seq_len, 1)
    q = torch.randn(query_len, num_heads, head_dim, device="cuda").to(DTYPE)
    k, v = layers.caches[0]
    qsl = torch.tensor([0, query_len], dtype=torch.int32, device="cuda")

    def ours(**tuning):
        return kernels.paged_attention(
            q, k, v, layers.page_table, qsl, layers.seq_lens, layers.scale, max_query_len=query_len, **tuning
        )

    # Causal FLOPs: 2 matmuls x 2 FLOP per MAC over the visible (query, key) pairs.
    pairs = query_len * context + query_len * (query_len + 1) / 2
    flops = 4 * num_heads * head_dim * pairs
    reference = ours()
    entry = dict(shape=shape, query_len=query_len, context=context, configs={})
    for bm, bn, w, st in PREFILL_CONFIGS[head_dim]:
        key = f"m{bm}_n{bn}_w{w}_s{st}"
        tuning = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
        try:
            err = rel_err(ours(**tuning), reference)
            if not err < 2e-2:
                entry["configs"][key] = f"WRONG: rel err {err:.3g}"
                continue
            t = time_graph(functools.partial(ours, **tuning), reps=10)
            entry["configs"][key] = dict(ms=t * 1e3, tflops=flops / t / 1e12)
        except Exception as error:  # noqa: BLE001 - e.g. out of shared memory
            entry["configs"][key] = f"failed: {type(error).__name__}"
    qd = torch.randn(1, num_heads, seq_len, head_dim, device="cuda").to(DTYPE)
    kd = torch.randn(1, num_kv_heads, seq_len, head_dim, device="cuda").to(DTYPE)
    sdpa = functools.partial(F.scaled_dot_product_attention, qd, kd, kd, is_causal=True, enable_gqa=True)
    t_sdpa = time_graph(sdpa, reps=10)
    entry["sdpa_causal_full_seq_ms"] = t_sdpa * 1e3
    entry["sdpa_tflops"] = 4 * num_heads * head_dim * (seq_len * (seq_len + 1) / 2) / t_sdpa / 1e12
    print("prefill", shape, json.dumps(entry), flush=True)
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="skip the split/block sweeps")
    parser.add_argument("--verify", action="store_true", help="verification rows (K + 1 queries) and their tile sweep only")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new cases after this long")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth()
    print(f"{props.name}: {props.multi_processor_count} SMs; copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    result = dict(device=props.name, sms=props.multi_processor_count, copy_bytes_per_s=copy_bw,
                  torch=torch.__version__, decode=[], prefill=None)
    try:
        if args.verify:
            result["verify"] = verify_cases(copy_bw, deadline)
            return 0
        result["decode"] = decode_cases(copy_bw, args.quick, deadline)
        if time.monotonic() < deadline:
            result["prefill"] = prefill_cases()
    finally:
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
