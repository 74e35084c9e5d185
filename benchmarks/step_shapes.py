"""Step shapes: what one engine step costs on the GPU, to choose the step token budgets.

Random weights in the real Qwen3.5 shapes (as `ninfer bench`), the server's KV page size, the
runner the server uses. Two tables:
  prefill  one request's prompt chunk of T tokens at context 0: step time, tok/s, peak memory
           beyond the pools (what --prefill-chunk costs and buys)
  mixed    B decode rows at --context tokens each (CUDA graph when P = 0) plus a P-token prompt
           chunk beside them: step time and its factor over the idle batch-1 decode step (what
           --mixed-prefill-chunk does to the running requests' inter-token time), and the
           prompt rate it gives
Timed with CUDA events after two warm-up runs, median of --repeats.

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="27b")
    parser.add_argument("--prefill", default="512,1024,2048,4096,8192,16384", help="prompt chunk sizes")
    parser.add_argument("--batches", default="1,4,8", help="decode rows beside the prompt chunk")
    parser.add_argument("--mixed", default="0,64,128,256,384,512,1024", help="prompt tokens beside decode rows")
    parser.add_argument("--context", type=int, default=4096, help="tokens in each decode row's cache")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", metavar="B,P", help="also profile one step of B decode rows + P prompt tokens: "
                        "the top kernels and host ops go to OUT's directory as step-profile.txt")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    prefills, batches, mixed = ints(args.prefill), ints(args.batches), ints(args.mixed)

    device = torch.device("cuda")
    _, config = shape_config(args.shape)
    log.info("building %s with random weights", args.shape)
    model = build_model(config, torch.bfloat16, device)
    fill_random_(stored_parameters(model), 0)
    model.eval()
    page_size = EngineConfig().page_size
    max_batch = max(batches)
    pages_per_row = -(-(args.context + 2) // page_size)
    prompt_pages = -(-max(max(prefills), max(mixed)) // page_size) + 1
    num_pages = max_batch * pages_per_row + prompt_pages
    runner = ModelRunner(model, num_pages, page_size, num_state_slots=max_batch + 1,
                         cuda_graph_batch_sizes=batches, max_context=args.context + 2)
    with torch.no_grad():
        runner.kv_cache.k.normal_()
        runner.kv_cache.v.normal_()
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

    results: dict = {"shape": args.shape, "page_size": page_size, "context": args.context, "prefill": [], "mixed": []}
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
    idle = None
    for batch in batches:
        for tokens in mixed:
            chunks = decode_rows(batch) + ([prompt_chunk(tokens)] if tokens else [])
            step = SchedulerStep(StepKind.MIXED if tokens else StepKind.DECODE, chunks)
            seconds = median_ms(lambda: runner.execute(step), args.repeats, warmup=2) / 1e3
            if batch == 1 and tokens == 0:
                idle = seconds
            row = {"decode_rows": batch, "prompt_tokens": tokens, "ms": seconds * 1e3,
                   "factor_over_idle": seconds / idle if idle else None,
                   "prompt_tok_per_s": tokens / seconds if tokens else 0.0}
            results["mixed"].append(row)
            log.info("decode %d + prompt %5d: %7.2f ms  x%.2f of idle  prompt %8.0f tok/s", batch, tokens, row["ms"],
                     row["factor_over_idle"] or 0.0, row["prompt_tok_per_s"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    if args.profile:
        batch, tokens = ints(args.profile)
        chunks = decode_rows(batch) + ([prompt_chunk(tokens)] if tokens else [])
        step = SchedulerStep(StepKind.MIXED if tokens else StepKind.DECODE, chunks)
        profile_step(lambda: runner.execute(step), Path(args.out).parent / "step-profile.txt", f"{batch}+{tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
