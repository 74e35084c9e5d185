"""Load benchmark: what users of a loaded ninfer-serve see, over HTTP.

Every request is a streamed OpenAI Chat Completion (httpx over a socket) of a fresh random-word
prompt (a random first token, so no request reuses another's prefix unless --shared-prefix puts a
common system prompt in front) asking for --output-tokens as max_tokens. The server has no
ignore_eos/min_tokens, so the length is not forced: every request reports its completion tokens
(from usage) and the summaries count requests that stopped short. Scenarios, each with its own
client pool against the same server:

  burst        --burst-requests (8) prompts of --prompt-tokens (4096) sent at once
  poisson      Poisson arrivals at --rate req/s for --duration s (or --num-requests), prompt lengths
               uniform in --prompt-range (1024,16384), at most --max-inflight (8) in flight client-side
               (a request that waits for a slot starts its clock when sent; its wait is recorded)
  concurrency  for c in --concurrency-levels (1,2,4,8): c closed-loop clients, each sending its next
               request when the previous one ends, --requests-per-client (4) each
  cold-start   (--serve only; run first, on the freshly started server) seconds to /health 200, then
               the first request's TTFT and end-to-end time against a second one of the same shape
               (other words); target: first <= 1.5 x warm

Per request: prompt, cached and completion tokens, TTFT (client side, to the first streamed
reasoning/content token), the gaps between successive streamed token chunks (ITL; the server
sends one chunk per committed token batch, and timings_per_token says how many tokens each one
carries), end-to-end time, HTTP status or error. Per scenario: TTFT, ITL (all gaps of all
requests) and end-to-end p50/p99 with their sample counts, output and prompt tok/s (totals over
the makespan, first send to last finish), errors by status.

--bench-rates FILE (a `ninfer bench` JSON, docs/perf/*bench-27b.json) adds the burst targets:
makespan <= 1.15 x (uncached prompt tokens / prefill rate + output tokens / per-stream batch-N decode
rate, N = min(burst, server concurrency)) and ITL p99 <= 3 x the idle inter-token time (1 / batch-1
decode rate), each printed met/not met. The rates are those measured nearest the burst's prompt length
and context; the weights are the served model's (fp8 when its config.json says so) unless named.

Writes load.jsonl (a run record, one record per request and one summary per scenario, appended
as they finish), load.md and server.log into --out; a short table on stdout, progress on stderr.
Exits 1 when any request failed.

  python3 benchmarks/load.py --serve /dev/shm/q27 --serve-command "python3 -m ninfer.cli serve" \\
      --server-args "--max-concurrency 8 --max-context 32768 --kv-capacity auto" \\
      --scenario burst,poisson,concurrency,cold-start --out $OUT/load \\
      [--bench-rates docs/perf/2026-12-01T21-bench-27b.json]
  python3 benchmarks/load.py --url http://127.0.0.1:8080 --scenario burst --burst-requests 4
  python3 -m pytest tests/bench/test_load.py   # a short burst and concurrency run on a tiny CPU artifact
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_process.py, also when imported by path
from serve_process import start_server, stop_server, wait_for_step_graphs, words  # noqa: E402

SCENARIOS = ("burst", "poisson", "concurrency", "cold-start")
# What a prompt holds besides its words, Qwen3.5 tokenizer: chat framing with the thinking opener (8),
# the nonce (17) and CONTINUE (12).
PROMPT_OVERHEAD_TOKENS = 37
# Real models otherwise answer random words briefly; random weights ignore it.
CONTINUE = "\n\nContinue the text above for as long as you can."
READY_RECORD = re.compile(r"ready in .*concurrency (\d+)\)")


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (NumPy's default):
    sorted values v[0..n-1], rank r = (n-1)·q/100, result v[floor r] + (r - floor r)·(v[ceil r] - v[floor r]).
    None when there are no values. Below 100 samples p99 lies between the two largest values, i.e. it
    is about the maximum: summaries report each percentile with the sample count it rests on."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


@dataclass
class RequestRecord:
    scenario: str
    group: str  # the scenario, or its level ("c=4") or phase ("first", "warm")
    index: int
    client: int  # the closed-loop client (concurrency), else the request index
    asked_output_tokens: int
    scheduled_s: float = 0.0  # planned send time, from the scenario's start
    sent_s: float = 0.0  # actual send time (later than planned when waiting for an in-flight slot)
    status: int | None = None  # HTTP status; None when the connection failed
    error: str | None = None
    request_id: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between successive token chunks
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each chunk carried (timings_per_token)
    decode_tok_per_s: float | None = None  # (tokens after the first chunk's) / (first to last chunk)
    server_prompt_s: float | None = None  # the engine's admission-to-first-token time (final timings)
    finished_s: float | None = None  # from the scenario's start

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200


def build_messages(rng: random.Random, prompt_tokens: int, shared_prefix: str | None, shared_tokens: int) -> list[dict]:
    nonce = f"{rng.getrandbits(64):x} "  # a fresh first token: nothing before it to reuse
    body_tokens = max(1, prompt_tokens - shared_tokens - PROMPT_OVERHEAD_TOKENS)
    messages = [{"role": "user", "content": nonce + words(rng, body_tokens) + CONTINUE}]
    if shared_prefix:
        # An explicit breakpoint: the server keeps a shared-prefix checkpoint only where one is marked.
        part = {"type": "text", "text": shared_prefix, "prompt_cache_breakpoint": {"mode": "explicit"}}
        messages.insert(0, {"role": "system", "content": [part]})
    return messages


class LoadClient:
    """One scenario's client pool: an httpx.AsyncClient and the request shape."""

    def __init__(self, args, model: str, scenario: str, started: float, sink):
        self.args = args
        self.model = model
        self.scenario = scenario
        self.started = started  # perf_counter of the scenario's start
        self.sink = sink
        self.http = httpx.AsyncClient(
            base_url=args.url, timeout=args.request_timeout, headers={"authorization": f"Bearer {args.api_key}"},
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def send(self, record: RequestRecord, messages: list[dict]) -> RequestRecord:
        body = {
            "model": self.model, "messages": messages, "max_tokens": record.asked_output_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "timings_per_token": True, **self.args.body_extra,
        }
        sent = time.perf_counter()
        record.sent_s = sent - self.started
        last_chunk, predicted, usage, timings = None, 0, None, None
        try:
            async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
                record.status = response.status_code
                record.request_id = response.headers.get("x-request-id")
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    record.error = error_message(text)
                else:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        now = time.perf_counter()
                        chunk = json.loads(line[len("data: "):])
                        if "error" in chunk:
                            record.error = "stream: " + error_message(json.dumps(chunk))
                            break
                        timings = chunk.get("timings") or timings
                        usage = chunk.get("usage") or usage
                        for choice in chunk.get("choices", []):
                            delta = choice.get("delta") or {}
                            record.finish_reason = choice.get("finish_reason") or record.finish_reason
                            if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                                if last_chunk is None:
                                    record.ttft_s = now - sent
                                else:
                                    record.itl_s.append(now - last_chunk)
                                last_chunk = now
                                count = (timings or {}).get("predicted_n", predicted + 1)
                                record.chunk_tokens.append(count - predicted)
                                predicted = count
        except httpx.HTTPError as error:
            record.error = f"transport: {type(error).__name__}: {error}"
        done = time.perf_counter()
        record.e2e_s = done - sent
        record.finished_s = done - self.started
        if usage is not None:
            record.prompt_tokens = usage["prompt_tokens"]
            record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            record.completion_tokens = usage["completion_tokens"]
            record.reasoning_tokens = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
        elif record.error is None:
            record.error = "stream: ended without a usage chunk"
        if timings:
            record.server_prompt_s = timings.get("prompt_ms", 0.0) / 1000.0
        if len(record.itl_s) > 0:
            record.decode_tok_per_s = sum(record.chunk_tokens[1:]) / sum(record.itl_s)
        self.sink(record)
        return record


def error_message(text: str) -> str:
    try:
        error = json.loads(text).get("error") or {}
        return f"{error.get('code') or error.get('type')}: {error.get('message')}"
    except (ValueError, AttributeError):
        return text[:200]


# ---- scenarios ---------------------------------------------------------------------------------


async def run_burst(args, model: str, sink) -> list[list[RequestRecord]]:
    client = LoadClient(args, model, "burst", time.perf_counter(), sink)
    rng = random.Random(f"{args.seed}:burst")
    prefix, prefix_tokens = shared_prefix(args)
    jobs = []
    for i in range(args.burst_requests):
        record = RequestRecord("burst", "burst", i, i, args.output_tokens)
        jobs.append(client.send(record, build_messages(rng, args.prompt_tokens, prefix, prefix_tokens)))
    try:
        return [list(await asyncio.gather(*jobs))]
    finally:
        await client.close()


async def run_poisson(args, model: str, sink) -> list[list[RequestRecord]]:
    rng = random.Random(f"{args.seed}:poisson")
    prefix, prefix_tokens = shared_prefix(args)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(args.rate)
        if (args.num_requests is not None and len(arrivals) >= args.num_requests) or (
                args.num_requests is None and t > args.duration):
            break
        arrivals.append(t)
    low, high = args.prompt_range
    client = LoadClient(args, model, "poisson", time.perf_counter(), sink)
    slots = asyncio.Semaphore(args.max_inflight)

    async def one(i: int, at: float, messages: list[dict]) -> RequestRecord:
        record = RequestRecord("poisson", "poisson", i, i, args.output_tokens, scheduled_s=at)
        async with slots:
            return await client.send(record, messages)

    jobs = []
    try:
        for i, at in enumerate(arrivals):
            messages = build_messages(rng, rng.randint(low, high), prefix, prefix_tokens)  # built before the wait
            delay = client.started + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            jobs.append(asyncio.create_task(one(i, at, messages)))
        return [list(await asyncio.gather(*jobs))]
    finally:
        await client.close()


async def run_concurrency(args, model: str, sink) -> list[list[RequestRecord]]:
    prefix, prefix_tokens = shared_prefix(args)
    groups = []
    for level in args.concurrency_levels:
        rng = random.Random(f"{args.seed}:concurrency:{level}")
        client = LoadClient(args, model, "concurrency", time.perf_counter(), sink)
        prompts = [[build_messages(rng, args.prompt_tokens, prefix, prefix_tokens)
                    for _ in range(args.requests_per_client)] for _ in range(level)]

        async def loop(k: int) -> list[RequestRecord]:
            done = []
            for j, messages in enumerate(prompts[k]):
                record = RequestRecord("concurrency", f"c={level}", k * args.requests_per_client + j, k,
                                       args.output_tokens)
                done.append(await client.send(record, messages))
            return done

        print(f"[concurrency] c={level}: {level} clients x {args.requests_per_client} requests",
              file=sys.stderr, flush=True)
        try:
            per_client = await asyncio.gather(*(loop(k) for k in range(level)))
        finally:
            await client.close()
        groups.append(sorted((r for records in per_client for r in records), key=lambda r: r.index))
    return groups


async def run_cold_start(args, model: str, sink) -> list[list[RequestRecord]]:
    """The freshly started server's first request, then one of the same shape (other words)."""
    rng = random.Random(f"{args.seed}:cold-start")
    prefix, prefix_tokens = shared_prefix(args)
    records = []
    for i, phase in enumerate(("first", "warm")):
        client = LoadClient(args, model, "cold-start", time.perf_counter(), sink)
        try:
            record = RequestRecord("cold-start", phase, i, 0, args.output_tokens)
            records.append(await client.send(record, build_messages(rng, args.prompt_tokens, prefix, prefix_tokens)))
        finally:
            await client.close()
    return [records]


RUNNERS = {"burst": run_burst, "poisson": run_poisson, "concurrency": run_concurrency, "cold-start": run_cold_start}


def shared_prefix(args) -> tuple[str | None, int]:
    if not args.shared_prefix:
        return None, 0
    return "Shared instructions. " + words(random.Random(f"{args.seed}:prefix"), args.shared_prefix), args.shared_prefix


# ---- summaries ---------------------------------------------------------------------------------


def summarize(records: list[RequestRecord], scenario: str, group: str, asked: int) -> dict:
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = str(r.status) if r.status not in (None, 200) else (r.error or "?").split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    starts = [r.sent_s for r in records]
    ends = [r.finished_s for r in records if r.finished_s is not None]
    makespan = max(ends) - min(starts) if records and ends else None
    completion = [r.completion_tokens for r in ok]
    prompt_total = sum(r.prompt_tokens or 0 for r in ok)
    cached_total = sum(r.cached_tokens or 0 for r in ok)
    summary = {
        "record": "summary", "scenario": scenario, "group": group, "requests": len(records), "succeeded": len(ok),
        "errors_by_status": errors, "asked_output_tokens": asked,
        "completion_tokens_min": min(completion, default=None), "completion_tokens_max": max(completion, default=None),
        # The server cannot force the length: a request that stopped early is counted, never hidden.
        "requests_not_at_asked_length": sum(1 for c in completion if c != asked),
        "prompt_tokens_total": prompt_total, "cached_tokens_total": cached_total,
        "completion_tokens_total": sum(completion),
        "makespan_s": makespan,
        "output_tok_per_s": sum(completion) / makespan if makespan else None,
        "prompt_tok_per_s": prompt_total / makespan if makespan else None,
        "prefilled_tok_per_s": (prompt_total - cached_total) / makespan if makespan else None,  # uncached only
        "max_client_wait_s": max((r.sent_s - r.scheduled_s for r in records), default=0.0) if scenario == "poisson"
        else None,
    }
    samples = {"ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
               "itl": [gap for r in ok for gap in r.itl_s],
               "e2e": [r.e2e_s for r in ok]}
    for name, values in samples.items():
        summary[f"{name}_p50_s"] = percentile(values, 50)
        summary[f"{name}_p99_s"] = percentile(values, 99)
        summary[f"{name}_samples"] = len(values)
    return summary


STEP_CLUSTER_S = 0.002  # token chunks of one server step reach the streams within this of each other


def prompt_phase_steps(records: list[RequestRecord]) -> dict | None:
    """The server steps the streams saw while prompts were still being computed (until the last
    first token), from each stream's token times: gap ends within STEP_CLUSTER_S of each other
    are one step, whose time is the largest gap it closes. -> the steps that delivered a first
    token (they end a prompt) and the others: counts, medians and p90s (None without such steps).
    What makes the inter-token p99 of a burst: every stream already decoding waits for each."""
    ok = [r for r in records if r.ok and r.ttft_s is not None]
    if len(ok) < 2:
        return None
    firsts = sorted(r.sent_s + r.ttft_s for r in ok)
    ends = []
    for r in ok:
        at = r.sent_s + r.ttft_s
        for gap in r.itl_s:
            at += gap
            if at <= firsts[-1] + STEP_CLUSTER_S:
                ends.append((at, gap))
    if not ends:
        return None
    ends.sort()
    steps: list[list[tuple[float, float]]] = [[ends[0]]]
    for end in ends[1:]:
        if end[0] - steps[-1][-1][0] <= STEP_CLUSTER_S:
            steps[-1].append(end)
        else:
            steps.append([end])
    prompt_ends, others = [], []
    for step in steps:
        lo, hi = step[0][0] - STEP_CLUSTER_S, step[-1][0] + STEP_CLUSTER_S
        (prompt_ends if any(lo <= f <= hi for f in firsts) else others).append(max(gap for _, gap in step))
    return {
        "prompt_end_steps": len(prompt_ends), "prompt_end_step_p50_s": percentile(prompt_ends, 50),
        "other_prompt_phase_steps": len(others), "other_step_p50_s": percentile(others, 50),
        "other_step_p90_s": percentile(others, 90),
    }


def cold_start_fields(summary: dict, records: list[RequestRecord], ready_s: float | None) -> None:
    first, warm = (records + [None, None])[:2]
    summary["ready_s"] = ready_s  # server process start to /health 200
    for name in ("ttft_s", "e2e_s"):
        a = getattr(first, name) if first is not None and first.ok else None
        b = getattr(warm, name) if warm is not None and warm.ok else None
        summary[f"first_{name}"], summary[f"warm_{name}"] = a, b
        summary[f"first_over_warm_{name.removesuffix('_s')}"] = a / b if a and b else None
    ratios = [summary["first_over_warm_ttft"], summary["first_over_warm_e2e"]]
    summary["targets"] = [{
        "target": "first request <= 1.5 x warm (TTFT and end-to-end)",
        "measured": f"TTFT {fmt(ratios[0], '.2f')}x, end-to-end {fmt(ratios[1], '.2f')}x",
        "met": None if None in ratios else all(x <= 1.5 for x in ratios),
    }]


# ---- targets from `ninfer bench` rates ---------------------------------------------------------


def read_bench_rates(path: str, weights: str | None, shape: str | None, model_dir: str | None) -> dict:
    """Prefill rates by prompt length and aggregate decode rates by (batch, context) for one shape and
    weights: the only ones in the file, the ones named, or (weights) what the served model's config says."""
    report = json.loads(Path(path).read_text())
    results = report["results"]
    shapes = sorted({r["shape"] for r in results})
    if shape is None:
        if len(shapes) != 1:
            raise SystemExit(f"--bench-rates {path} holds shapes {shapes}: name one with --bench-shape")
        shape = shapes[0]
    kinds = sorted({r["weights"] for r in results if r["shape"] == shape})
    if weights is None:
        if len(kinds) == 1:
            weights = kinds[0]
        elif model_dir is not None:
            weights = "fp8" if served_fp8(model_dir) else "bf16"
        else:
            raise SystemExit(f"--bench-rates {path} holds weights {kinds}: name one with --bench-weights")
    chosen = [r for r in results if r["shape"] == shape and r["weights"] == weights]
    return {
        "file": path, "shape": shape, "weights": weights,
        "prefill": sorted((r["tokens"], r["tokens_per_s"]) for r in chosen if r["kind"] == "prefill"),
        "decode": {(r["batch"], r["tokens"]): r["tokens_per_s"] for r in chosen if r["kind"] == "decode"},
    }


def served_fp8(model_dir: str) -> bool:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (config.get("quantization_config") or {}).get("quant_method") == "fp8"


def nearest(options, x: float):
    return min(options, key=lambda o: abs(o - x))


def decode_rate(rates: dict, batch: int, context: float) -> tuple[float, str] | None:
    """Aggregate decode tok/s at `batch` streams, at the measured context nearest `context`; between
    measured batches the aggregate is interpolated linearly."""
    if not rates["decode"]:
        return None
    ctx = nearest({c for _, c in rates["decode"]}, context)
    points = sorted((b, r) for (b, c), r in rates["decode"].items() if c == ctx)
    below = [p for p in points if p[0] <= batch] or points[:1]
    above = [p for p in points if p[0] >= batch] or points[-1:]
    (b0, r0), (b1, r1) = below[-1], above[0]
    rate = r0 if b1 == b0 else r0 + (r1 - r0) * (batch - b0) / (b1 - b0)
    source = f"batch {b0}" if b1 == b0 else f"batch {b0}..{b1} interpolated"
    return rate, f"{source}, context {ctx}"


def burst_targets(summary: dict, records: list[RequestRecord], rates: dict, server_concurrency: int | None) -> list:
    ok = [r for r in records if r.ok]
    if not ok:
        return []
    streams = min(len(records), server_concurrency or len(records))  # the server decodes at most this many at once
    prompt_mean = sum(r.prompt_tokens for r in ok) / len(ok)
    output = max(r.completion_tokens for r in ok)  # the longest stream ends the burst
    targets = []
    decode = decode_rate(rates, streams, prompt_mean + output)
    if rates["prefill"] and decode:
        length, prefill = min(rates["prefill"], key=lambda p: abs(p[0] - prompt_mean))
        prefilled = summary["prompt_tokens_total"] - summary["cached_tokens_total"]
        per_stream = decode[0] / streams
        bound = 1.15 * (prefilled / prefill + output / per_stream)
        targets.append({
            "target": f"makespan <= 1.15 x ({prefilled} prompt tokens / {prefill:.0f} tok/s prefill (at {length}) + "
                      f"{output} output tokens / {per_stream:.1f} tok/s per stream ({decode[1]}, {streams} streams))",
            "bound": bound, "measured": summary["makespan_s"],
            "met": summary["makespan_s"] is not None and summary["makespan_s"] <= bound,
        })
    idle = decode_rate(rates, 1, prompt_mean + output)
    if idle:
        bound = 3.0 / idle[0]
        targets.append({
            "target": f"ITL p99 <= 3 x idle inter-token time (1 / {idle[0]:.1f} tok/s, {idle[1]})",
            "bound": bound, "measured": summary["itl_p99_s"],
            "met": summary["itl_p99_s"] is not None and summary["itl_p99_s"] <= bound,
        })
    return targets


# ---- output ------------------------------------------------------------------------------------


def fmt(value, spec: str, scale: float = 1.0) -> str:
    return "–" if value is None else format(value * scale, spec)


TABLE_HEAD = ("| scenario | requests | errors | prompt tok (mean) | cached | out tok/req | TTFT p50 s | TTFT p99 s | "
              "ITL p50 ms | ITL p99 ms | e2e p50 s | e2e p99 s | out tok/s | prompt tok/s | makespan s |")


def table(summaries: list[dict]) -> str:
    lines = [TABLE_HEAD, "|" + "---|" * TABLE_HEAD.count(" | ") + "---|"]
    for s in summaries:
        name = s["scenario"] if s["group"] == s["scenario"] else f"{s['scenario']} {s['group']}"
        errors = ", ".join(f"{k}: {v}" for k, v in s["errors_by_status"].items()) or "0"
        low, high = s["completion_tokens_min"], s["completion_tokens_max"]
        out = "–" if low is None else str(low) if low == high else f"{low}..{high}"
        if s["requests_not_at_asked_length"]:
            out += f" ({s['requests_not_at_asked_length']} != {s['asked_output_tokens']})"
        prompt_mean = s["prompt_tokens_total"] / s["succeeded"] if s["succeeded"] else None
        cached = s["cached_tokens_total"] / s["prompt_tokens_total"] if s["prompt_tokens_total"] else None
        lines.append(
            f"| {name} | {s['requests']} | {errors} | {fmt(prompt_mean, '.0f')} | {fmt(cached, '.0%')} | {out} "
            f"| {fmt(s['ttft_p50_s'], '.3f')} | {fmt(s['ttft_p99_s'], '.3f')} (n={s['ttft_samples']}) "
            f"| {fmt(s['itl_p50_s'], '.1f', 1e3)} | {fmt(s['itl_p99_s'], '.1f', 1e3)} (n={s['itl_samples']}) "
            f"| {fmt(s['e2e_p50_s'], '.2f')} | {fmt(s['e2e_p99_s'], '.2f')} (n={s['e2e_samples']}) "
            f"| {fmt(s['output_tok_per_s'], '.1f')} | {fmt(s['prompt_tok_per_s'], '.0f')} | {fmt(s['makespan_s'], '.2f')} |")
    return "\n".join(lines)


def target_lines(summaries: list[dict]) -> list[str]:
    lines = []
    for s in summaries:
        for t in s.get("targets", []):
            verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
            measured = t["measured"] if isinstance(t["measured"], str) else fmt(t["measured"], ".4g")
            bound = f" (bound {t['bound']:.4g})" if "bound" in t else ""
            lines.append(f"- {s['scenario']}: {t['target']}: measured {measured}{bound}: **{verdict}**")
    return lines


def prompt_phase_lines(summaries: list[dict]) -> list[str]:
    lines = []
    for s in summaries:
        steps = s.get("prompt_phase_steps")
        if steps:
            lines.append(
                f"- {s['scenario']}: while prompts were computed, the {steps['prompt_end_steps']} steps that ended a "
                f"prompt closed gaps of {fmt(steps['prompt_end_step_p50_s'], '.1f', 1e3)} ms (median), the other "
                f"{steps['other_prompt_phase_steps']} {fmt(steps['other_step_p50_s'], '.1f', 1e3)} ms "
                f"(p90 {fmt(steps['other_step_p90_s'], '.1f', 1e3)} ms)")  # fmt: skip
    return lines


def cold_start_lines(summaries: list[dict]) -> list[str]:
    return [f"- cold-start: ready in {fmt(s['ready_s'], '.1f')} s; first request TTFT {fmt(s['first_ttft_s'], '.3f')} s, "
            f"end-to-end {fmt(s['first_e2e_s'], '.2f')} s; warm TTFT {fmt(s['warm_ttft_s'], '.3f')} s, end-to-end "
            f"{fmt(s['warm_e2e_s'], '.2f')} s" for s in summaries if s["scenario"] == "cold-start"]


def progress(record: RequestRecord) -> None:
    state = "ok" if record.ok else f"ERROR {record.status}: {record.error}"
    print(f"  {record.scenario} {record.group} #{record.index}: prompt {record.prompt_tokens} "
          f"cached {record.cached_tokens} out {record.completion_tokens} ttft {fmt(record.ttft_s, '.3f')}s "
          f"e2e {fmt(record.e2e_s, '.2f')}s {state}", file=sys.stderr, flush=True)


# ---- main --------------------------------------------------------------------------------------


def warm_up(args, model: str) -> None:
    """One request of the burst's prompt length, so the first scenario does not pay one-time costs."""
    async def once():
        client = LoadClient(args, model, "warm-up", time.perf_counter(), lambda r: None)
        try:
            record = RequestRecord("warm-up", "warm-up", 0, 0, min(16, args.output_tokens))
            return await client.send(record, build_messages(random.Random("warm-up"), args.prompt_tokens, None, 0))
        finally:
            await client.close()
    record = asyncio.run(once())
    if not record.ok:
        raise SystemExit(f"warm-up request failed: {record.status} {record.error}")
    print(f"warm-up: ttft {record.ttft_s:.3f}s, e2e {record.e2e_s:.2f}s", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--serve", metavar="MODEL", help="start ninfer-serve on this model directory (log: OUT/server.log)")
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8080")
    parser.add_argument("--server-args", default="", help="extra ninfer-serve flags, one string")
    parser.add_argument("--serve-command", default="ninfer-serve",
                        help="how to start the server (default ninfer-serve; e.g. 'python3 -m ninfer.cli serve')")
    parser.add_argument("--scenario", action="append", help=f"comma list of {', '.join(SCENARIOS)}; repeatable (default burst)")
    parser.add_argument("--output-tokens", type=int, default=256, help="max_tokens of every request (default 256)")
    parser.add_argument("--prompt-tokens", type=int, default=4096,
                        help="prompt length of burst, concurrency and cold-start requests, about (default 4096)")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                        help="a common system prompt of about this many tokens in front of every prompt (default 0: none)")
    parser.add_argument("--burst-requests", type=int, default=8, help="burst: requests sent at once (default 8)")
    parser.add_argument("--rate", type=float, default=0.5, help="poisson: mean arrivals per second (default 0.5)")
    parser.add_argument("--duration", type=float, default=60.0, help="poisson: seconds of arrivals (default 60)")
    parser.add_argument("--num-requests", type=int, help="poisson: this many arrivals instead of --duration")
    parser.add_argument("--prompt-range", default="1024,16384", help="poisson: prompt tokens MIN,MAX, uniform (default 1024,16384)")
    parser.add_argument("--max-inflight", type=int, default=8, help="poisson: client-side cap on requests in flight (default 8)")
    parser.add_argument("--concurrency-levels", default="1,2,4,8", help="concurrency: closed-loop client counts (default 1,2,4,8)")
    parser.add_argument("--requests-per-client", type=int, default=4, help="concurrency: requests per client (default 4)")
    parser.add_argument("--body-extra", default="{}", help="JSON merged into every request body, e.g. "
                        "'{\"chat_template_kwargs\": {\"enable_thinking\": false}}'")
    parser.add_argument("--bench-rates", metavar="FILE", help="a `ninfer bench` JSON result: print the burst targets")
    parser.add_argument("--bench-weights", choices=["bf16", "fp8"],
                        help="which weights' rates in FILE (default: the only ones, else the served model's config)")
    parser.add_argument("--bench-shape", help="which shape's rates in FILE (default: the only one)")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="one request before the scenarios (default on; cold-start's requests replace it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8199, help="port for --serve (default 8199)")
    parser.add_argument("--api-key", default="unused", help="Bearer token (default: a placeholder)")
    parser.add_argument("--ready-timeout", type=float, default=1800.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="folder for load.jsonl, load.md and server.log (default: a temp dir)")
    args = parser.parse_args(argv)
    names = [n for group in (args.scenario or ["burst"]) for n in group.split(",") if n]
    bad = [n for n in names if n not in SCENARIOS]
    if bad:
        parser.error(f"--scenario: unknown {', '.join(bad)} (choose from {', '.join(SCENARIOS)})")
    # cold-start measures the fresh server: it runs first, whatever the order given.
    args.scenarios = sorted(dict.fromkeys(names), key=lambda n: n != "cold-start")
    if "cold-start" in args.scenarios and not args.serve:
        parser.error("--scenario cold-start needs --serve (it times the server's start and first request)")
    args.prompt_range = tuple(int(x) for x in args.prompt_range.split(","))
    args.concurrency_levels = [int(x) for x in args.concurrency_levels.split(",") if x]
    args.body_extra = json.loads(args.body_extra)
    if args.rate <= 0 or args.max_inflight < 1 or args.output_tokens < 1:
        parser.error("--rate, --max-inflight and --output-tokens must be positive")
    args.out = args.out or tempfile.mkdtemp(prefix="load-")
    os.makedirs(args.out, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    jsonl = out / "load.jsonl"
    jsonl.write_text("")
    rates = read_bench_rates(args.bench_rates, args.bench_weights, args.bench_shape, args.serve) if args.bench_rates else None

    def write(record: dict) -> None:
        with open(jsonl, "a") as raw:  # line by line: survives an interrupted run
            raw.write(json.dumps(record) + "\n")

    def sink(record: RequestRecord) -> None:
        write({"record": "request", **asdict(record)})
        progress(record)

    process = ready_s = None
    log_path = out / "server.log" if args.serve else None
    if args.serve:
        started = time.perf_counter()
        process = start_server(shlex.split(args.serve_command), args.serve, shlex.split(args.server_args), args.port,
                               log_path, args.ready_timeout, poll_s=0.1)
        ready_s = time.perf_counter() - started
        args.url = f"http://127.0.0.1:{args.port}"
    summaries = []
    try:
        model = httpx.get(f"{args.url}/v1/models", timeout=10).json()["data"][0]["id"]
        write({"record": "run", "model": model, "options": {k: v for k, v in vars(args).items() if k != "api_key"},
               "bench_rates": {k: v for k, v in (rates or {}).items() if k in ("file", "shape", "weights")} or None})
        if args.warmup and "cold-start" not in args.scenarios:
            warm_up(args, model)
        for name in args.scenarios:
            if log_path is not None and name != "cold-start":
                wait_for_step_graphs(log_path)  # after cold-start: the others measure the steady state
            print(f"[{name}]", file=sys.stderr, flush=True)
            for records in asyncio.run(RUNNERS[name](args, model, sink)):
                summary = summarize(records, name, records[0].group if name == "concurrency" else name,
                                    args.output_tokens)
                if name == "cold-start":
                    cold_start_fields(summary, records, ready_s)
                if name == "burst":
                    summary["prompt_phase_steps"] = prompt_phase_steps(records)
                if name == "burst" and rates is not None:
                    summary["targets"] = burst_targets(summary, records, rates, server_concurrency(log_path))
                write(summary)
                summaries.append(summary)
    finally:
        if process is not None:
            stop_server(process)
    report = ["## Load", "", f"Model `{model}`; {args.output_tokens} output tokens asked per request.", "",
              table(summaries), ""]
    extra = cold_start_lines(summaries) + prompt_phase_lines(summaries) + target_lines(summaries)
    if rates is not None:
        extra.append(f"- rates: {rates['file']} ({rates['shape']}, {rates['weights']})")
    short = sum(s["requests_not_at_asked_length"] for s in summaries)
    if short:
        extra.append(f"- {short} requests ended before {args.output_tokens} tokens (see completion_tokens in load.jsonl)")
    report += extra
    (out / "load.md").write_text("\n".join(report) + "\n")
    print("\n".join([table(summaries), "", *extra]))
    print(f"written: {jsonl}, {out / 'load.md'}" + (f", {log_path}" if log_path else ""), file=sys.stderr)
    return 0 if all(not s["errors_by_status"] for s in summaries) else 1


def server_concurrency(log_path: Path | None) -> int | None:
    """--max-concurrency as the server reported it when ready (None for --url)."""
    if log_path is None or not log_path.exists():
        return None
    match = READY_RECORD.search(log_path.read_text(errors="replace"))
    return int(match.group(1)) if match else None


if __name__ == "__main__":
    sys.exit(main())
