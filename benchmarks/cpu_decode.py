"""Single-stream prefill and decode speed of `ninfer-serve` on the embedded default model, over HTTP.

Starts `ninfer-serve` (default model, CPU) as a subprocess, streams greedy chat completions
(a ~300-token prompt, 128 output tokens) and prints per-run and median figures:

  prefill tok/s  prompt tokens / time to the first streamed token (server side: the engine's
                 own prompt stamps, reported as llama.cpp-style `timings`)
  decode tok/s   (tokens - 1) / time from the first to the last streamed token, as the client
                 sees it (and the server's predicted_per_second next to it)

Each run's prompt starts with a different sentence so no run reuses another's cached prefix.

    python benchmarks/cpu_decode.py [--runs 3] [--max-tokens 128] [--dtype auto] [-- extra ninfer-serve args]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

PASSAGE = (
    "The history of the lighthouse is a story of coastlines, ships and the people who kept the lamps burning. "
    "Early lighthouses were simple fires on hilltops, later replaced by towers of stone with oil lamps and "
    "mirrors. In the nineteenth century the Fresnel lens changed everything: a lens made of concentric rings "
    "of glass could bend the light of a single flame into a beam visible for many miles. Keepers lived in "
    "small cottages next to the towers, trimming wicks, polishing brass and writing the weather in their "
    "logbooks every few hours. Storms could cut them off from the mainland for weeks, and supply boats "
    "brought food, oil and letters whenever the sea allowed. Many keepers raised families on rocky islands, "
    "teaching their children to read by lamplight and to watch the horizon for ships in distress. With "
    "electricity came automatic lamps, radio beacons and finally satellite navigation, and one by one the "
    "keepers left their posts. Today many towers are museums, hotels or nesting places for sea birds, and "
    "volunteers climb their spiral stairs to repaint the railings and show visitors the great lenses that "
    "once guided sailors home through fog and darkness. "
)
QUESTION = (
    "Using the passage above, write a long, detailed essay of at least ten paragraphs about the life of a "
    "lighthouse keeper, the technology of lighthouses, and why they still matter today."
)
OPENINGS = (
    "Read the following passage carefully.",
    "Here is a passage about maritime history.",
    "Consider this text about the sea.",
    "Please study the passage below.",
    "A short history lesson follows.",
    "This passage comes from a museum guide.",
    "Below is an article from a travel magazine.",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(base: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"ninfer-serve exited with {server.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("ninfer-serve did not become ready")


def one_run(base: str, run: int, max_tokens: int) -> dict:
    prompt = f"{OPENINGS[run % len(OPENINGS)]}\n\n{PASSAGE}\n{QUESTION}"
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    token_times: list[float] = []
    usage = timings = None
    started = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600.0) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("timings"):
                timings = chunk["timings"]
            for choice in chunk.get("choices", ()):
                if choice.get("delta", {}).get("content"):
                    token_times.append(time.perf_counter())
    completion = usage["completion_tokens"] if usage else len(token_times)
    first, last = token_times[0], token_times[-1]
    return {
        "prompt_tokens": usage["prompt_tokens"] if usage else None,
        "completion_tokens": completion,
        "ttft_s": first - started,
        "prefill_tok_s": timings["prompt_per_second"] if timings else None,
        # Content chunks may carry several tokens (stop-string holdback): count tokens, not chunks.
        "decode_tok_s": (completion - 1) / (last - first) if last > first else float("nan"),
        "server_decode_tok_s": timings["predicted_per_second"] if timings else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the server (default: the engine's choice)")
    parser.add_argument("serve_args", nargs="*", help="extra ninfer-serve options (after --)")
    args = parser.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    command = ["ninfer-serve", "--port", str(port), "--dtype", args.dtype, *args.serve_args]
    log = tempfile.TemporaryFile("w+")
    server = subprocess.Popen(command, env=env, stderr=log, start_new_session=True)
    try:
        wait_ready(base, server, timeout_s=300)
        one_run(base, len(OPENINGS) - 1, 8)  # warm-up: first-call allocations, lazy imports
        results = []
        for run in range(args.runs):
            result = one_run(base, run, args.max_tokens)
            results.append(result)
            print(
                f"run {run + 1}: prompt {result['prompt_tokens']} tok, prefill {result['prefill_tok_s']:.0f} tok/s "
                f"(ttft {result['ttft_s']:.3f} s), decode {result['decode_tok_s']:.1f} tok/s over "
                f"{result['completion_tokens']} tok (server {result['server_decode_tok_s']:.1f})",
                flush=True,
            )
    except BaseException:
        log.seek(0)
        sys.stderr.write(log.read()[-4000:])
        raise
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()

    log.seek(0)
    # The engine's start-up record names the dtype it resolved and its torch threads.
    loading = next((line.split(" INFO ", 1)[-1].strip() for line in log if "INFO loading" in line), "?")
    print(
        f"median of {args.runs}: prefill {statistics.median(r['prefill_tok_s'] for r in results):.0f} tok/s, "
        f"decode {statistics.median(r['decode_tok_s'] for r in results):.1f} tok/s "
        f"({loading}; {' '.join(command)})"
    )


if __name__ == "__main__":
    sys.exit(main())
