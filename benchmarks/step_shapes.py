"""Step shapes: what one engine step costs on the GPU, to choose the step token budgets.

Random weights in the real Qwen3.5 shapes (as `ninfer bench`), the server's KV page size, the
runner the server uses: with the step graphs the server captures (engine/step_graphs.py) and,
beside it on the same weights, with every prompt step eager. Two tables:
  prefill  one request's prompt chunk of T tokens at context 0: step time, tok/s, peak memory
           beyond the pools (what --prefill-chunk costs and buys)
  mixed    B decode rows at --context tokens each (B may be 0; the decode graphs when P = 0) plus
           a P-token prompt chunk beside them: step time with and without step graphs, the sum of
           the step's kernel times (the floor a step can reach when the host keeps ahead), its
           factor over the idle batch-1 decode step (what --mixed-prefill-chunk does to the
           running requests' inter-token time), and the prompt rate it gives
Timed with CUDA events after two warm-up runs, median of --repeats; kernel time from a profile of
three runs.

  python3 benchmarks/step_shapes.py --shape 27b --out results/step-shapes-27b.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from ninfer.bench.random_weights import fill_random_, stored_parameters
from ninfer.bench.roofline import median_ms
from ninfer.bench.shapes import shape_config
from ninfer.config import EngineConfig
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.runner import ModelRunner
from ninfer.engine.scheduler import ScheduledChunk, SchedulerStep, StepKind
from ninfer.models.loader import build_model

log = logging.getLogger("step_shapes")
GREEDY = SamplingParams(temperature=0.0, seed=0)


def profile_step(fn, path: Path, label: str) -> None:
    """Kernel and host-op tables of 3 runs of fn, plus wall time against summed kernel time."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / 3
    events = prof.key_averages()
    kernel_s = sum(e.device_time_total for e in events if e.device_type.name == "CUDA") / 1e6 / 3
    text = [f"step {label}: wall {wall * 1e3:.2f} ms per step, kernels {kernel_s * 1e3:.2f} ms per step",
            events.table(sort_by="device_time_total", row_limit=30),
            events.table(sort_by="self_cpu_time_total", row_limit=30)]
    path.write_text("\n\n".join(text))
    log.info("%s", text[0])


def kernel_ms(fn) -> float:
    """Summed device time of the kernels of one run of fn (profile of three, after two warm-ups)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") / 1e3 / 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="27b")
    parser.add_argument("--prefill", default="512,1024,2048,4096,8192,16384", help="prompt chunk sizes")
    parser.add_argument("--batches", default="0,1,8", help="decode rows beside the prompt chunk")
    parser.add_argument("--mixed", default="0,1,16,64,256,1024,4096", help="prompt tokens beside decode rows")
    parser.add_argument("--context", type=int, default=4096, help="tokens in each decode row's cache")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", metavar="B,P", help="also profile one step of B decode rows + P prompt tokens: "
                        "the top kernels and host ops, with step graphs and eager, go to OUT's directory as "
                        "step-profile-graphs.txt and step-profile-eager.txt")
    parser.add_argument("--three-half-buckets", action="store_true",
                        help="also step graphs of 384, 768 ... tokens (engine/step_graphs.py THREE_HALF_BUCKETS)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.three_half_buckets:
        from ninfer.engine import step_graphs

        step_graphs.THREE_HALF_BUCKETS = True
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    prefills, batches, mixed = ints(args.prefill), ints(args.batches), ints(args.mixed)

    device = torch.device("cuda")
    _, config = shape_config(args.shape)
    log.info("building %s with random weights", args.shape)
    model = build_model(config, torch.bfloat16, device)
    fill_random_(stored_parameters(model), 0)
    model.eval()
    max_batch = max(max(batches), 1)
    engine = EngineConfig(max_concurrency=max_batch)
    page_size = engine.page_size
    pages_per_row = -(-(args.context + 2) // page_size)
    prompt_pages = -(-max(max(prefills, default=0), max(mixed)) // page_size) + 1
    num_pages = max_batch * pages_per_row + prompt_pages
    max_context = max(args.context + 2, prompt_pages * page_size)
    decode_sizes = [b for b in batches if b > 0]
    runners = {}
    for label, step_graph_tokens in (("graphs", engine.step_graph_tokens), ("eager", 0)):
        started = time.perf_counter()
        runner = runners[label] = ModelRunner(
            model, num_pages, page_size, num_state_slots=max_batch + 1, cuda_graph_batch_sizes=decode_sizes,
            max_context=max_context, max_batch=max_batch, step_graph_tokens=step_graph_tokens,
        )
        log.info("%s runner built in %.1f s (%.2f GiB of GPU memory reserved so far)", label,
                 time.perf_counter() - started, torch.cuda.memory_reserved() / 2**30)
        with torch.no_grad():
            runner.kv_cache.k.normal_()
            runner.kv_cache.v.normal_()
    runner = runners["graphs"]
    results_buckets = runner.step_graphs.buckets if runner.step_graphs is not None else []
    prompt_slot = max_batch
    prompt_page_ids = list(range(max_batch * pages_per_row, num_pages))
    vocab = min(200_000, config.vocab_size)

    def prompt_chunk(num_tokens: int) -> ScheduledChunk:
        tokens = torch.randint(0, vocab, (num_tokens,)).tolist()
        return ScheduledChunk("p", tokens, 0, prompt_page_ids, prompt_slot, compute_logits=False, sample=False,
                              sampling=GREEDY, num_generated=0, output_token_ids=[])

    def decode_rows(batch: int) -> list[ScheduledChunk]:
        return [
            ScheduledChunk(f"d{b}", [1000 + b], args.context, list(range(b * pages_per_row, (b + 1) * pages_per_row)),
                           b, compute_logits=True, sample=True, sampling=GREEDY, num_generated=0, output_token_ids=[])
            for b in range(batch)
        ]

    results: dict = {"shape": args.shape, "page_size": page_size, "context": args.context,
                     "step_graph_buckets": results_buckets, "prefill": [], "mixed": []}
    for tokens in prefills:
        step = SchedulerStep(StepKind.PREFILL, [prompt_chunk(tokens)])
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        seconds = median_ms(lambda: runner.execute(step), args.repeats, warmup=2) / 1e3
        peak = torch.cuda.max_memory_allocated() - base
        row = {"tokens": tokens, "ms": seconds * 1e3, "tok_per_s": tokens / seconds, "peak_gib": peak / 2**30}
        results["prefill"].append(row)
        log.info("prefill %6d tokens: %8.2f ms  %9.0f tok/s  peak +%.2f GiB", tokens, row["ms"], row["tok_per_s"],
                 row["peak_gib"])
    idle_step = SchedulerStep(StepKind.DECODE, decode_rows(1))
    idle = median_ms(lambda: runner.execute(idle_step), args.repeats, warmup=2) / 1e3
    for batch in batches:
        for tokens in mixed:
            if batch == 0 and tokens == 0:
                continue
            chunks = decode_rows(batch) + ([prompt_chunk(tokens)] if tokens else [])
            kind = StepKind.MIXED if tokens and batch else StepKind.PREFILL if tokens else StepKind.DECODE
            step = SchedulerStep(kind, chunks)
            row = {"decode_rows": batch, "prompt_tokens": tokens}
            for label, timed in runners.items():
                seconds = median_ms(lambda: timed.execute(step), args.repeats, warmup=2) / 1e3
                row[f"{label}_ms"] = seconds * 1e3
            # The kernels of the eager step (the same kernels, launched one by one).
            row["kernel_ms"] = kernel_ms(lambda: runners["eager"].execute(step))
            row["wall_over_kernels"] = row["graphs_ms"] / row["kernel_ms"]
            row["factor_over_idle"] = row["graphs_ms"] / 1e3 / idle
            row["prompt_tok_per_s"] = tokens / row["graphs_ms"] * 1e3 if tokens else 0.0
            results["mixed"].append(row)
            log.info("decode %d + prompt %5d: %7.2f ms with step graphs, %7.2f eager, kernels %7.2f (x%.2f)"
                     "  x%.2f of idle  prompt %8.0f tok/s", batch, tokens, row["graphs_ms"], row["eager_ms"],
                     row["kernel_ms"], row["wall_over_kernels"], row["factor_over_idle"],
                     row["prompt_tok_per_s"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    if args.profile:
        batch, tokens = ints(args.profile)
        chunks = decode_rows(batch) + ([prompt_chunk(tokens)] if tokens else [])
        step = SchedulerStep(StepKind.MIXED if tokens else StepKind.DECODE, chunks)
        for label, profiled in runners.items():
            profile_step(lambda: profiled.execute(step), Path(args.out).parent / f"step-profile-{label}.txt",
                         f"{batch}+{tokens} {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
