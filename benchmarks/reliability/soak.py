"""Overload soak: 10x the admission capacity (max_concurrency + max_pending_requests) of concurrent
clients for --minutes, mixed streaming and aggregate requests over Chat Completions, Responses and
Messages, against a ninfer-serve it starts on loopback.

Each client sends its next request as soon as the last one ends; a refused client pauses 0..100 ms
(not Retry-After's 1 s, so the waiting room stays full). Prompts are random words of 8..96 tokens,
outputs 1..48 tokens. The run is --rounds equal rounds; after each, the server must settle and pass
the accounting checks of harness.py (waiting-room capacity, whole KV pool, pool gauges, RSS).

Targets (exit 1 when one is missed):
  - every refusal is the protocol's capacity refusal with Retry-After: 429 server_overloaded or
    503 request_queue_timeout (Chat, Responses), 529 overloaded_error or 504 timeout_error (Messages);
  - every admitted request completes with its full shape: finish/stop reason, usage, the SSE
    framing ([DONE]; created..terminal with sequence numbers; message_start..message_stop);
  - after every round: nothing runs or waits, every waiting-room place is free (capacity requests
    are placed, one more is refused 429), a request reserving the whole KV pool is admitted, and
    no pool gauge (KV pages, state slots, host slots, checkpoints) rises every round;
  - RSS flat: from the end of the first (warm-up) round to the end of the last, neither process
    grows by more than --rss-growth-mib.

  python3 benchmarks/reliability/soak.py --minutes 10 --rounds 5 --out /tmp/soak        # full run
  python3 benchmarks/reliability/soak.py --minutes 0.4 --rounds 2 --out /tmp/soak-ci    # CI size
  python3 -m pytest tests/server/test_reliability_campaign.py -k "soak or overload"     # the CI runs

--artifact tiny (default) builds the tiny random Qwen3.5 test artifact (hybrid: state slots and
host slots take part); --artifact embedded serves the embedded SmolLM2; or give a model path.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

SERVER_ARGS = ("--max-concurrency 2 --max-pending-requests 8 --pending-timeout-ms 2500 --max-context 1024 "
               "--response-store-max-records 64")
CLIENTS_PER_PLACE = 10
REFUSED_PAUSE_S = 0.1
PROMPT_TOKENS = (8, 96)
OUTPUT_TOKENS = (1, 48)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="total load time (default 10)")
    parser.add_argument("--rounds", type=int, default=5, help="load rounds, each followed by the checks (default 5)")
    parser.add_argument("--artifact", default="tiny", help="tiny | embedded | a model path (default tiny)")
    parser.add_argument("--server-args", default=SERVER_ARGS, help=f"(default {SERVER_ARGS!r})")
    parser.add_argument("--rss-growth-mib", type=float, default=24.0, help="RSS bound per process (default 24)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="server.log, requests.jsonl, soak.json")
    return parser.parse_args(argv)


async def client_loop(client: httpx.AsyncClient, model: str, rng: random.Random, deadline: float,
                      tally: harness.Tally) -> None:
    while time.monotonic() < deadline:
        api = rng.choice(harness.APIS)
        payload = harness.body(api, model, harness.prompt(rng, rng.randint(*PROMPT_TOKENS)),
                              rng.randint(*OUTPUT_TOKENS), rng.random() < 0.5)
        outcome, status = await harness.request(client, api, payload)
        tally.add(api, outcome, status)
        if outcome == "rejected":
            await asyncio.sleep(rng.uniform(0, REFUSED_PAUSE_S))


async def load_round(server: harness.Server, clients: int, seconds: float, rng: random.Random) -> harness.Tally:
    tally = harness.Tally()
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300, limits=limits) as client:
        await asyncio.gather(*(client_loop(client, server.model, random.Random(rng.getrandbits(64)), deadline, tally)
                               for _ in range(clients)))
    return tally


async def soak(args: argparse.Namespace, server: harness.Server) -> dict:
    rng = random.Random(args.seed)
    clients = CLIENTS_PER_PLACE * server.capacity
    round_seconds = args.minutes * 60 / args.rounds
    report = {"clients": clients, "capacity": server.capacity, "round_seconds": round_seconds,
              "server_args": args.server_args, "rounds": [], "problems": []}
    baseline = await harness.pool_gauges(server)
    report["baseline_gauges"] = baseline
    report["rss_start_mib"] = server.rss_mib()
    for number in range(1, args.rounds + 1):
        tally = await load_round(server, clients, round_seconds, rng)
        checks = await harness.round_checks(server, number, report["problems"])
        report["rounds"].append({"round": number, **tally.summary(), **checks})
        print(f"round {number}: {tally.requests} requests {dict(tally.statuses)} rss {checks['rss_mib']}",
              file=sys.stderr)
        if tally.failures:
            report["problems"].append(f"round {number}: {len(tally.failures)} bad responses")
    harness.judge_growth(report, args.rss_growth_mib)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = harness.start(harness.resolve_artifact(args.artifact, args.out), shlex.split(args.server_args), args.out)
    try:
        report = asyncio.run(soak(args, server))
    finally:
        server.stop()
    harness.write_report(args.out, "soak", report)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
