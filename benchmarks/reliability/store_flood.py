"""Responses store flood: the local response store at its record and MiB limits, against a ninfer-serve
it starts on loopback (--response-store-max-records 64, --response-store-max-mib 1 by default).

Phases, each checked as it runs:
  lru     fill the store to its record limit, touch the oldest record (GET), create two more: the two
          least recently used records go (404), the touched one and the rest stay (200).
  chain   a --depth previous_response_id chain (default 200). Every turn is created (200). Each record
          is charged its whole Item history, so the MiB limit evicts the chain's early links: a link
          is retrievable (200) or gone (404 response_not_found), never a 500; the last link and its
          input_items are retrievable, and a child of the last retained link whose parent is gone
          still continues the chain.
  flood   --workers concurrent clients for --seconds: creates (roots, and children of random known
          ids), retrieves, input_items, deletes of known ids and of ids that never existed. Allowed:
          create 200, 404 response_not_found (the parent was evicted or deleted) or a capacity
          refusal (429/503); retrieve and input_items 200 or 404; delete 200 or 404, and always 404
          for an id that never existed or was already deleted. A retrieved object has its own id.
Then every id that answered 200 last is retrieved again and, while still retained, continued
with one child (each child evicts the least recently used record, so about half are).

Bounds (exit 1 when one is missed): no 500 and nothing outside the allowed statuses; the store
never holds more than its limits (measured from outside: the API process's RSS after the flood
rounds stays within --rss-growth-mib of its size after the first; in-process, the CI test reads
the store's own byte count). --rounds repeats chain + flood.

The MiB budget counts the compact JSON bytes of each record's response, input Items and history
(store.py json_size), not Python heap: docs/reliability.md gives the measured ratio (about 0.3x
for chains, whose records share Item dicts, up to about 3x for many small records).

  python3 benchmarks/reliability/store_flood.py --depth 200 --seconds 60 --rounds 3 --out /tmp/flood      # full
  python3 benchmarks/reliability/store_flood.py --depth 60 --seconds 8 --rounds 1 --out /tmp/flood-ci     # CI size
  python3 -m pytest tests/server/test_reliability_campaign.py -k store                                    # the CI runs

--artifact as in soak.py (default: the tiny random Qwen3.5 test artifact).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

SERVER_ARGS = ("--max-concurrency 2 --max-pending-requests 30 --max-context 8192 "
               "--response-store-max-records 64 --response-store-max-mib 1")
OUTPUT_TOKENS = 2
CAPACITY_REFUSALS = (429, 503)


class Flood:
    def __init__(self, server: harness.Server, client: httpx.AsyncClient, max_records: int):
        self.server = server
        self.client = client
        self.max_records = max_records
        self.statuses: Counter = Counter()
        self.problems: list[str] = []
        self.alive: dict[str, str | None] = {}  # id -> its parent, for ids last seen stored
        self.gone: set[str] = set()  # ids deleted by this client

    def expect(self, what: str, response: httpx.Response, allowed: tuple[int, ...]) -> bool:
        self.statuses[f"{what}:{response.status_code}"] += 1
        if response.status_code not in allowed:
            self.problems.append(f"{what}: {response.status_code} {response.text[:200]}")
            return False
        if response.status_code == 404 and response.json()["error"]["code"] != "response_not_found":
            self.problems.append(f"{what}: 404 {response.json()['error']}")
        return True

    async def create(self, text: str, parent: str | None = None, allowed=(200,)) -> str | None:
        payload = {"model": self.server.model, "input": text, "max_output_tokens": OUTPUT_TOKENS}
        if parent is not None:
            payload["previous_response_id"] = parent
        response = await self.client.post("/v1/responses", json=payload)
        if not self.expect("create", response, allowed) or response.status_code != 200:
            return None
        body = response.json()
        if body["previous_response_id"] != parent or body["status"] not in ("completed", "incomplete"):
            self.problems.append(f"create: {body['id']} answered {body['status']} with parent {body['previous_response_id']}")
        self.alive[body["id"]] = parent
        return body["id"]

    async def retrieve(self, response_id: str, allowed=(200, 404)) -> int:
        response = await self.client.get(f"/v1/responses/{response_id}")
        if self.expect("retrieve", response, allowed) and response.status_code == 200:
            if response.json()["id"] != response_id:
                self.problems.append(f"retrieve {response_id}: got {response.json()['id']}")
        if response.status_code == 404:
            self.alive.pop(response_id, None)
        return response.status_code

    async def input_items(self, response_id: str) -> int:
        response = await self.client.get(f"/v1/responses/{response_id}/input_items")
        self.expect("input_items", response, (200, 404))
        return response.status_code

    async def delete(self, response_id: str, allowed=(200, 404)) -> int:
        response = await self.client.delete(f"/v1/responses/{response_id}")
        self.expect("delete", response, allowed)
        if response.status_code == 200:
            self.alive.pop(response_id, None)
            self.gone.add(response_id)
        return response.status_code

    # ---- phases ---------------------------------------------------------------------------------
    async def lru(self) -> dict:
        ids = [await self.create(f"lru record {i}") for i in range(self.max_records)]
        await self.retrieve(ids[0], allowed=(200,))  # now the most recently used
        for i in range(2):
            await self.create(f"lru pusher {i}")
        for response_id, expected in ((ids[1], 404), (ids[2], 404), (ids[3], 200), (ids[0], 200)):
            if await self.retrieve(response_id) != expected:
                self.problems.append(f"lru: {response_id} (record {ids.index(response_id)}) is not {expected}")
        return {"records": self.max_records, "evicted_first": [1, 2], "kept": [0, 3]}

    async def chain(self, depth: int) -> dict:
        links = [await self.create("chain turn 0")]
        for turn in range(1, depth):
            link = await self.create(f"chain turn {turn}", links[-1])
            if link is None:
                self.problems.append(f"chain: turn {turn} was not created")
                return {"depth": turn}
            links.append(link)
        retained = [await self.retrieve(link) == 200 for link in links]
        if not retained[-1] or await self.input_items(links[-1]) != 200:
            self.problems.append("chain: the last link is not retrievable")
        first = retained.index(True)
        if any(not kept for kept in retained[first:]):
            self.problems.append("chain: a link newer than a retained one is gone (not LRU)")
        if first > 0 and await self.create("after an evicted parent", links[first]) is None:
            self.problems.append("chain: the oldest retained link cannot be continued")
        return {"depth": depth, "retained_links": sum(retained), "oldest_retained_turn": first}

    async def flood(self, workers: int, seconds: float, rng: random.Random) -> dict:
        deadline = time.monotonic() + seconds
        seen = list(self.alive)

        async def worker(worker_rng: random.Random) -> None:
            while time.monotonic() < deadline:
                choice = worker_rng.random()
                known = worker_rng.choice(seen) if seen else None
                if choice < 0.3 or known is None:
                    parent = known if worker_rng.random() < 0.5 else None
                    created = await self.create(f"flood {worker_rng.getrandbits(32):08x}", parent,
                                                allowed=(200, 404, *CAPACITY_REFUSALS))
                    if created:
                        seen.append(created)
                elif choice < 0.6:
                    await self.retrieve(known)
                elif choice < 0.7:
                    await self.input_items(known)
                elif choice < 0.85:
                    if await self.delete(known) == 200 and await self.delete(known, allowed=(404,)) != 404:
                        self.problems.append(f"flood: a second delete of {known} did not 404")
                else:
                    await self.delete(f"resp_{worker_rng.getrandbits(128):032x}", allowed=(404,))

        await asyncio.gather(*(worker(random.Random(rng.getrandbits(64))) for _ in range(workers)))
        for response_id in self.gone:
            await self.retrieve(response_id, allowed=(404,))
        continued = 0
        for response_id in list(self.alive):
            if await self.retrieve(response_id) == 200:
                continued += await self.create("continue after the flood", response_id) is not None
        return {"ids_seen": len(seen), "deleted": len(self.gone), "continued_after": continued}


async def flood_rounds(args: argparse.Namespace, server: harness.Server) -> dict:
    rng = random.Random(args.seed)
    report = {"server_args": args.server_args, "rounds": [], "problems": [], "rss_start_mib": server.rss_mib()}
    limits = httpx.Limits(max_connections=args.workers + 4)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300, limits=limits) as client:
        flood = Flood(server, client, args.max_records)
        report["lru"] = await flood.lru()
        for number in range(1, args.rounds + 1):
            chain = await flood.chain(args.depth)
            burst = await flood.flood(args.workers, args.seconds, rng)
            rss = server.rss_mib()
            report["rounds"].append({"round": number, "chain": chain, "flood": burst, "rss_mib": rss})
            print(f"round {number}: chain {chain} flood {burst} rss {rss}", file=sys.stderr)
        report["statuses"] = dict(sorted(flood.statuses.items()))
        report["requests"] = sum(flood.statuses.values())
        report["problems"] += flood.problems[:50]
    if "Traceback" in (args.out / "server.log").read_text():
        report["problems"].append("the server log holds a traceback")
    first, last = report["rounds"][0]["rss_mib"], report["rounds"][-1]["rss_mib"]
    report["rss_growth_mib"] = {p: round(last[p] - first[p], 1) for p in ("api", "engine")}
    if report["rss_growth_mib"]["api"] > args.rss_growth_mib:
        report["problems"].append(f"API RSS grew {first['api']:.1f} -> {last['api']:.1f} MiB")
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=200, help="previous_response_id chain length (default 200)")
    parser.add_argument("--workers", type=int, default=32, help="concurrent flood clients (default 32)")
    parser.add_argument("--seconds", type=float, default=60.0, help="flood time per round (default 60)")
    parser.add_argument("--rounds", type=int, default=3, help="chain + flood rounds (default 3)")
    parser.add_argument("--artifact", default="tiny", help="tiny | embedded | a model path (default tiny)")
    parser.add_argument("--server-args", default=SERVER_ARGS, help=f"(default {SERVER_ARGS!r})")
    parser.add_argument("--rss-growth-mib", type=float, default=16.0, help="API RSS bound (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="server.log, requests.jsonl, store_flood.json")
    args = parser.parse_args(argv)
    server_args = shlex.split(args.server_args)
    args.max_records = int(server_args[server_args.index("--response-store-max-records") + 1])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = harness.start(harness.resolve_artifact(args.artifact, args.out), shlex.split(args.server_args), args.out)
    try:
        report = asyncio.run(flood_rounds(args, server))
    finally:
        server.stop()
    harness.write_report(args.out, "store_flood", report)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
