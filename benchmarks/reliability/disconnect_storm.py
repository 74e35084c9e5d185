"""Disconnect storm: --clients raw-socket clients (default 1,000) that vanish at random points of
their request, against a ninfer-serve it starts on loopback, --concurrency of them at a time
(default: the admission capacity, so the lanes stay busy and clients wait behind them).

Where a client vanishes (one at random per client, over Chat, Responses and Messages):
  preparation       sends the headers and half the body, then closes
  waiting           sends a request while the lanes are busy and closes 0..0.5 s later, unread
  prefill           sends a ~700-token prompt and closes 0..1 s later (the prompt is computing)
  decode_aggregate  an aggregate request of 200 output tokens, closed 0.2..1.5 s later
  mid_stream        a stream, closed after 1..3000 bytes of its body (mostly inside an event)
  between_events    a stream, closed right after its 1st..8th complete event
and how: FIN (an ordinary close) or RST (SO_LINGER 0, then close).

The storm runs in --rounds; after each the server must settle and pass the accounting checks of
harness.py. Targets (exit 1 when one is missed):
  - zero leaks: nothing runs or waits; every waiting-room place is free (capacity concurrent
    requests are all placed and one more is refused 429); a request reserving the whole KV pool is
    admitted; no pool gauge (KV pages, state slots, host slots, checkpoints) rises every round;
  - the request log closes every started request with exactly one terminal, and no terminal is an
    internal error (500); the server log holds no traceback;
  - no response-store leak: a Responses stream whose id the client saw is retrievable exactly when
    its generation finished (request_done), else 404 response_not_found;
  - RSS flat: from the end of the first round to the end of the last, neither process grows by
    more than --rss-growth-mib.

  python3 benchmarks/reliability/disconnect_storm.py --clients 1000 --rounds 4 --out /tmp/storm    # full run
  python3 benchmarks/reliability/disconnect_storm.py --clients 100 --rounds 2 --out /tmp/storm-ci  # CI size
  python3 -m pytest tests/server/test_reliability_campaign.py -k storm                             # the CI runs

--artifact as in soak.py (default: the tiny random Qwen3.5 test artifact).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import socket
import struct
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

SERVER_ARGS = "--max-concurrency 2 --max-pending-requests 8 --pending-timeout-ms 5000 --max-context 1024"
VANISH_POINTS = ("preparation", "waiting", "prefill", "decode_aggregate", "mid_stream", "between_events")
CLOSE_MODES = ("fin", "rst")
LONG_PROMPT_TOKENS = 700
STREAM_POINTS = ("mid_stream", "between_events")
HEADER_TIMEOUT_S = 30.0  # a stream's headers come at admission; the pending timeout is shorter


@dataclass
class Plan:
    api: str
    point: str
    mode: str
    stream: bool
    payload: dict
    delay_s: float  # waiting, prefill, decode_aggregate: how long after sending to vanish
    read_limit: int  # mid_stream: body bytes; between_events: complete events


@dataclass
class Seen:
    """What a client saw before it vanished."""

    status: int | None = None
    request_id: str | None = None
    response_id: str | None = None  # a Responses stream's id, from response.created


@dataclass
class StormTally:
    plans: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    responses_seen: list[tuple[str, str]] = field(default_factory=list)  # (request id, response id)

    def add(self, plan: Plan, seen: Seen) -> None:
        self.plans[f"{plan.point}/{plan.mode}"] += 1
        self.statuses[str(seen.status) if seen.status else "none"] += 1
        if seen.request_id and seen.response_id:
            self.responses_seen.append((seen.request_id, seen.response_id))


def make_plan(rng: random.Random, model: str) -> Plan:
    point = rng.choice(VANISH_POINTS)
    api = rng.choice(harness.APIS)
    stream = point in STREAM_POINTS or rng.random() < 0.5
    if point == "decode_aggregate":
        stream = False
    prompt_tokens = LONG_PROMPT_TOKENS if point == "prefill" else rng.randint(8, 64)
    max_tokens = 200 if point in ("decode_aggregate", "waiting", "prefill") else rng.randint(16, 64)
    payload = harness.body(api, model, harness.prompt(rng, prompt_tokens), max_tokens, stream)
    delay = {"waiting": rng.uniform(0, 0.5), "prefill": rng.uniform(0, 1.0),
             "decode_aggregate": rng.uniform(0.2, 1.5)}.get(point, 0.0)
    read_limit = rng.randint(1, 3000) if point == "mid_stream" else rng.randint(1, 8)
    return Plan(api, point, rng.choice(CLOSE_MODES), stream, payload, delay, read_limit)


def raw_request(path: str, payload: dict) -> tuple[bytes, bytes]:
    body = json.dumps(payload).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head, body


def vanish(writer: asyncio.StreamWriter, mode: str) -> None:
    """FIN: an ordinary close. RST: SO_LINGER 0 makes the kernel reset the connection."""
    if mode == "rst":
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        writer.close()


async def read_head(reader: asyncio.StreamReader, seen: Seen) -> dict[str, str]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEADER_TIMEOUT_S)
    lines = head.decode("latin-1").split("\r\n")
    seen.status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    seen.request_id = headers.get("x-request-id") or headers.get("request-id")
    return headers


async def read_chunk(reader: asyncio.StreamReader) -> bytes:
    """One chunk of a chunked body (each SSE event is written as one)."""
    size = int((await reader.readline()).split(b";")[0], 16)
    data = await reader.readexactly(size + 2)
    return data[:-2]


def note_response_id(event: bytes, seen: Seen) -> None:
    if seen.response_id is None and event.startswith(b"event: response.created"):
        payload = json.loads(event.split(b"\ndata: ", 1)[1])
        seen.response_id = payload["response"]["id"]


async def run_client(port: int, plan: Plan) -> Seen:
    seen = Seen()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head, body = raw_request(harness.PATHS[plan.api], plan.payload)
        if plan.point == "preparation":
            writer.write(head + body[: len(body) // 2])
            await writer.drain()
            return seen
        writer.write(head + body)
        await writer.drain()
        if plan.point not in STREAM_POINTS:
            await asyncio.sleep(plan.delay_s)
            return seen
        await read_head(reader, seen)
        if seen.status != 200:
            return seen  # refused: it vanishes with the refusal unread
        if plan.point == "between_events":
            for _ in range(plan.read_limit):
                event = await read_chunk(reader)
                if not event:
                    break
                note_response_id(event, seen)
        else:
            received = b""
            while len(received) < plan.read_limit:
                data = await reader.read(plan.read_limit - len(received))
                if not data:
                    break
                received += data
            first_event = received.split(b"\r\n", 1)[-1]
            with contextlib.suppress(ValueError, IndexError, KeyError):
                note_response_id(first_event.split(b"\n\n")[0], seen)
        return seen
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError):
        return seen
    finally:
        vanish(writer, plan.mode)


async def storm(port: int, model: str, clients: int, concurrency: int, rng: random.Random) -> StormTally:
    """`clients` vanishing clients, `concurrency` at a time."""
    tally = StormTally()
    gate = asyncio.Semaphore(concurrency)

    async def one(plan: Plan) -> None:
        async with gate:
            tally.add(plan, await run_client(port, plan))

    await asyncio.gather(*(one(make_plan(rng, model)) for _ in range(clients)))
    return tally


def log_terminals(records: list[dict]) -> tuple[Counter, list[str]]:
    """Terminal kinds of the request log, and the started requests without exactly one terminal."""
    kinds: Counter = Counter()
    terminals: Counter = Counter()
    started = set()
    for record in records:
        event = record["event"]
        if event == "request_start":
            started.add(record["request_id"])
        elif event in ("request_done", "request_error"):
            terminals[record["request_id"]] += 1
            kind = event if event == "request_done" else f"request_error:{record['phase']}:{record.get('code')}"
            kinds[kind] += 1
        elif event == "request_rejected":
            kinds[f"request_rejected:{record.get('code')}"] += 1
    unclosed = sorted(rid for rid in started if terminals[rid] != 1)
    return kinds, unclosed


async def check_store(server: harness.Server, responses_seen: list[tuple[str, str]], done: set[str]) -> dict:
    """A seen Responses stream is stored exactly when its generation finished."""
    stored = missing = 0
    wrong = []
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        for request_id, response_id in responses_seen:
            response = await client.get(f"/v1/responses/{response_id}")
            finished = request_id in done
            if response.status_code == 200 and finished:
                stored += 1
            elif response.status_code == 404 and not finished:
                missing += 1
            else:
                wrong.append(f"{response_id}: {response.status_code}, generation finished: {finished}")
    return {"stored": stored, "not_stored": missing, "wrong": wrong}


async def storm_rounds(args: argparse.Namespace, server: harness.Server) -> dict:
    rng = random.Random(args.seed)
    port = int(server.base_url.rsplit(":", 1)[1])
    per_round = args.clients // args.rounds
    concurrency = args.concurrency or server.capacity
    report = {"clients": per_round * args.rounds, "concurrency": concurrency, "server_args": args.server_args,
              "rounds": [], "problems": []}
    baseline = await harness.pool_gauges(server)
    report["baseline_gauges"] = baseline
    report["rss_start_mib"] = server.rss_mib()
    for number in range(1, args.rounds + 1):
        round_starts = len(server.read_log())
        tally = await storm(port, server.model, per_round, concurrency, rng)
        checks = await harness.round_checks(server, number, report["problems"])
        log = server.read_log()
        unclosed = log_terminals(log)[1]
        kinds = log_terminals(log[round_starts:])[0]  # this round's storm and checks
        done = {r["request_id"] for r in log if r["event"] == "request_done"}
        store = await check_store(server, tally.responses_seen, done)
        report["rounds"].append({"round": number, "plans": dict(sorted(tally.plans.items())),
                                 "statuses_seen": dict(sorted(tally.statuses.items())),
                                 "log_terminals": dict(sorted(kinds.items())), "store": store, **checks})
        print(f"round {number}: {per_round} clients, log {dict(kinds)}, rss {checks['rss_mib']}", file=sys.stderr)
        if unclosed:
            dropped = sum(r.get("request_log_dropped_events", 0) for r in log if r["event"] == "throughput")
            report["problems"].append(f"round {number}: {len(unclosed)} started requests without one terminal "
                                      f"({dropped} log events dropped)")
        if internal := [k for k in kinds if ":internal_error" in k or ":server_error" in k]:
            report["problems"].append(f"round {number}: internal errors {internal}")
        if store["wrong"]:
            report["problems"].append(f"round {number}: store entries {store['wrong'][:5]}")
    if "Traceback" in (args.out / "server.log").read_text():
        report["problems"].append("the server log holds a traceback")
    harness.judge_growth(report, args.rss_growth_mib)
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1000, help="vanishing clients in all (default 1000)")
    parser.add_argument("--rounds", type=int, default=4, help="the clients are split over rounds (default 4)")
    parser.add_argument("--concurrency", type=int, help="clients alive at once (default: the admission capacity)")
    parser.add_argument("--artifact", default="tiny", help="tiny | embedded | a model path (default tiny)")
    parser.add_argument("--server-args", default=SERVER_ARGS, help=f"(default {SERVER_ARGS!r})")
    parser.add_argument("--rss-growth-mib", type=float, default=24.0, help="RSS bound per process (default 24)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="server.log, requests.jsonl, disconnect_storm.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = harness.start(harness.resolve_artifact(args.artifact, args.out), shlex.split(args.server_args), args.out)
    try:
        report = asyncio.run(storm_rounds(args, server))
    finally:
        server.stop()
    harness.write_report(args.out, "disconnect_storm", report)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
