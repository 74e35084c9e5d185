"""What the reliability scenarios (soak.py, disconnect_storm.py, store_flood.py) share: a ninfer-serve
subprocess on loopback with its request log, the three protocols' request bodies and response-shape
checks, and the accounting checks that say whether the server returned to its baseline.

Accounting, for a server in its own process (nothing inside it is visible):
  - settle: GET /metrics until no request runs or waits.
  - capacity: max_concurrency long streams run and max_pending_requests wait (per /metrics), then one
    more request must get 429. A leaked waiting-room place makes an earlier request 429; a place
    that was never taken would admit the extra one.
  - whole KV pool: the server runs with --kv-capacity equal to --max-context, and one request whose
    prompt plus output reserves every KV page must be admitted. Cached checkpoints give their pages
    up under pressure, so a single page held by nobody keeps it waiting until its queue timeout.
  - pool gauges: fixed flush conversations (more than the context cache keeps), then a probe; the
    throughput records taken while the probe decodes give KV pages, state slots, host slots and
    checkpoints. What the cache keeps depends on its history (spill or drop is a cost decision), so
    these are compared across rounds: a gauge that rises after every round is a leak.
  - RSS: VmRSS of the API process and of the engine process (its multiprocessing child).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # serve_process.py
from serve_process import stop_server, words  # noqa: E402

from ninfer.testing.processes import engine_process_of, rss_mib

APIS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
# What each protocol answers a refusal of capacity with (spec: Anthropic uses 529 and 504).
REJECTIONS = {
    "chat": {429: "server_overloaded", 503: "request_queue_timeout"},
    "responses": {429: "server_overloaded", 503: "request_queue_timeout"},
    "messages": {529: "overloaded_error", 504: "timeout_error"},
}
POOL_GAUGES = ("kv_pages_used", "state_slots_used", "host_state_slots_used", "host_kv_pages_used", "checkpoints")
STATS_INTERVAL_MS = 200
FLUSH_MAX_TOKENS = 4
PROBE_MAX_TOKENS = 96  # several stats intervals of pure decode on the tiny CPU model
CAPACITY_HOLD_TOKENS = 400  # long enough that the held streams outlast the capacity check


# ---- the server ------------------------------------------------------------------------------------
@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    request_log: Path
    model: str
    max_concurrency: int
    max_pending_requests: int
    limits: dict  # server_start capacities: KV pages and context (whole-pool check), cache limits (flush)
    records: list[dict] = field(default_factory=list)  # the request log read so far
    _log_offset: int = 0

    @property
    def capacity(self) -> int:
        return self.max_concurrency + self.max_pending_requests

    @property
    def engine_pid(self) -> int:
        return engine_process_of(self.process.pid)

    def rss_mib(self) -> dict[str, float]:
        return {"api": rss_mib(self.process.pid), "engine": rss_mib(self.engine_pid)}

    def read_log(self) -> list[dict]:
        """The request log so far (records are appended to `records` as they are read)."""
        with open(self.request_log, "rb") as log:
            log.seek(self._log_offset)
            data = log.read()
        end = data.rfind(b"\n") + 1  # a record still being written is read next time
        self._log_offset += end
        self.records += [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        return self.records

    def stop(self) -> None:
        stop_server(self.process)


def resolve_artifact(name: str, out: Path) -> str | None:
    """--artifact: tiny (the tiny random Qwen3.5 test artifact, built under out), embedded, or a path."""
    if name == "embedded":
        return None
    if name == "tiny":
        from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5

        return str(make_tiny_qwen3_5(out / "artifacts"))
    return name


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(artifact: str | None, server_args: list[str], out: Path, ready_timeout: float = 300.0) -> Server:
    """ninfer-serve on a free loopback port (artifact None: the embedded default model), with its
    request log and throughput records every STATS_INTERVAL_MS; returns once /health is 200."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    request_log = out / "requests.jsonl"
    request_log.unlink(missing_ok=True)
    command = [sys.executable, "-m", "ninfer.cli", "serve", *([artifact] if artifact else []),
               "--host", "127.0.0.1", "--port", str(port), "--request-log-jsonl", str(request_log),
               "--log-stats-interval-ms", str(STATS_INTERVAL_MS), *server_args]
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    # Its own process group, so stop_server also stops the engine process it spawned.
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(out / "server.log", "w"),  # noqa: SIM115
                               start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while True:
        if process.poll() is not None:
            raise SystemExit(f"ninfer-serve exited with {process.returncode}; see {out / 'server.log'}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(process)
            raise SystemExit(f"ninfer-serve was not ready within {ready_timeout:.0f}s")
        time.sleep(0.3)
    model = httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    server = Server(process, base_url, request_log, model, 0, 0, {})
    start_record = next(r for r in server.read_log() if r["event"] == "server_start")
    capacities = start_record["capacities"]
    if capacities["kv_tokens"] != capacities["max_context"]:
        stop_server(process)
        raise SystemExit("the whole-KV-pool check needs --kv-capacity equal to --max-context")
    server.max_concurrency = capacities["max_concurrency"]
    server.max_pending_requests = start_record["max_pending_requests"]
    server.limits = capacities
    return server






# ---- request bodies and response shapes --------------------------------------------------------------
def body(api: str, model: str, prompt: str, max_tokens: int, stream: bool, **extra) -> dict:
    if api == "responses":
        payload = {"model": model, "input": prompt, "max_output_tokens": max_tokens}
    else:
        payload = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    if api == "chat" and stream:
        payload["stream_options"] = {"include_usage": True}  # the usage chunk the check requires
    return {**payload, "stream": stream, **extra}


def prompt(rng: random.Random, num_tokens: int) -> str:
    """Random words behind a nonce, so no two prompts share more than the template's framing."""
    return f"{rng.getrandbits(48):012x} " + words(rng, num_tokens)


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) per SSE event; comments (the keep-alive) are transport only."""
    events = []
    for block in text.split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            events.append((name, "\n".join(data)))
    return events


class ShapeError(AssertionError):
    """An admitted request whose response is incomplete or malformed."""


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ShapeError(what)


def _check_usage(prompt_tokens: int, output_tokens: int, total: int | None = None) -> None:
    _check(prompt_tokens > 0 and output_tokens >= 1, f"usage counts {prompt_tokens}/{output_tokens}")
    _check(total is None or total == prompt_tokens + output_tokens, "usage total is not prompt + output")


def check_response(api: str, stream: bool, text: str) -> None:
    """Raise ShapeError unless `text` is one complete, well-formed response of `api`."""
    if not stream:
        payload = json.loads(text)
        if api == "chat":
            _check(payload["choices"][0]["finish_reason"] in ("stop", "length"), "chat finish_reason")
            usage = payload["usage"]
            _check_usage(usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])
        elif api == "responses":
            _check(payload["status"] in ("completed", "incomplete"), f"response status {payload['status']}")
            usage = payload["usage"]
            _check_usage(usage["input_tokens"], usage["output_tokens"], usage["total_tokens"])
        else:
            _check(payload["type"] == "message", "messages type")
            _check(payload["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence"), "stop_reason")
            usage = payload["usage"]
            _check_usage(usage["input_tokens"] + usage["cache_read_input_tokens"], usage["output_tokens"])
        return
    events = sse_events(text)
    _check(bool(events), "empty stream")
    if api == "chat":
        _check(events[-1][1] == "[DONE]" and sum(data == "[DONE]" for _, data in events) == 1, "chat [DONE]")
        chunks = [json.loads(data) for _, data in events[:-1]]
        _check(all("error" not in chunk for chunk in chunks), "chat in-stream error")
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        _check(finishes in (["stop"], ["length"]), f"chat finish reasons {finishes}")
        usage = chunks[-1].get("usage")
        _check(usage is not None and chunks[-1]["choices"] == [], "chat usage chunk last")
        _check_usage(usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])
    elif api == "responses":
        payloads = [json.loads(data) for _, data in events]
        _check(all(name == p["type"] for (name, _), p in zip(events, payloads)), "event names match types")
        _check([p["sequence_number"] for p in payloads] == list(range(len(payloads))), "sequence numbers")
        types = [p["type"] for p in payloads]
        _check(types[:2] == ["response.created", "response.in_progress"], f"responses opening {types[:2]}")
        terminals = [t for t in types if t in ("response.completed", "response.incomplete", "response.failed")]
        _check(terminals == [types[-1]] and types[-1] != "response.failed", f"responses terminal {terminals}")
        usage = payloads[-1]["response"]["usage"]
        _check_usage(usage["input_tokens"], usage["output_tokens"], usage["total_tokens"])
    else:
        payloads = [json.loads(data) for _, data in events]
        types = [p["type"] for p in payloads]
        _check(types[0] == "message_start" and types[-1] == "message_stop", f"messages framing {types[:1]}..{types[-1:]}")
        _check("error" not in types, "messages in-stream error")
        starts = [p["index"] for p in payloads if p["type"] == "content_block_start"]
        stops = [p["index"] for p in payloads if p["type"] == "content_block_stop"]
        _check(starts == stops, "content blocks opened and closed")
        deltas = [p for p in payloads if p["type"] == "message_delta"]
        _check(len(deltas) == 1, "one message_delta")
        _check(deltas[0]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence"), "stop_reason")
        start_usage = payloads[0]["message"]["usage"]
        _check_usage(start_usage["input_tokens"] + start_usage["cache_read_input_tokens"],
                     deltas[0]["usage"]["output_tokens"])


def check_rejection(api: str, status: int, response: httpx.Response, text: str) -> None:
    """Raise ShapeError unless this is the protocol's capacity refusal, with Retry-After."""
    payload = json.loads(text)
    error = payload["error"]
    label = error["type"] if api == "messages" else error["code"]
    _check(REJECTIONS[api].get(status) == label, f"{api} refusal {status} {label}")
    _check(response.headers.get("retry-after") is not None, "refusal without Retry-After")


@dataclass
class Tally:
    """Outcomes by API ('ok', 'rejected' or 'bad: why') and the HTTP statuses seen."""

    outcomes: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def add(self, api: str, outcome: str, status: int | None) -> None:
        self.outcomes[f"{api}:{outcome}"] += 1
        if status is not None:
            self.statuses[str(status)] += 1
        if outcome.startswith("bad"):
            self.failures.append(f"{api}: {outcome}")

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values())

    def summary(self) -> dict:
        return {"requests": self.requests, "statuses": dict(sorted(self.statuses.items())),
                "outcomes": dict(sorted(self.outcomes.items())), "failures": self.failures[:20],
                "num_failures": len(self.failures)}


async def request(client: httpx.AsyncClient, api: str, payload: dict) -> tuple[str, int | None]:
    """Send one request and judge it: ('ok', 200), ('rejected', status) or ('bad: why', status)."""
    stream = payload["stream"]
    try:
        async with client.stream("POST", PATHS[api], json=payload) as response:
            text = (await response.aread()).decode()
    except httpx.HTTPError as exc:
        return f"bad: transport {type(exc).__name__}", None
    status = response.status_code
    try:
        if status == 200:
            check_response(api, stream, text)
            return "ok", status
        check_rejection(api, status, response, text)
        return "rejected", status
    except (ShapeError, KeyError, IndexError, TypeError, ValueError) as exc:
        return f"bad: {status} {type(exc).__name__} {exc} :: {text[-300:]!r}", status


# ---- accounting -------------------------------------------------------------------------------------
def metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        match = re.match(r"^(ninfer:[a-z_]+)\{[^}]*\} (\S+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


async def settle(server: Server, timeout: float = 120.0) -> dict:
    """Wait until the server runs and queues nothing (clients may have just gone away)."""
    began = time.monotonic()
    while True:
        values = await asyncio.to_thread(metrics, server.base_url)
        if values["ninfer:num_requests_running"] == 0 and values["ninfer:num_requests_waiting"] == 0:
            return {"seconds": round(time.monotonic() - began, 2)}
        if time.monotonic() > began + timeout:
            raise AssertionError(f"the server did not settle: {values}")
        await asyncio.sleep(0.1)


async def check_capacity(server: Server, timeout: float = 60.0) -> dict:
    """Every waiting-room place is free: capacity concurrent requests are all let in (the running
    ones stream, the rest wait), and one more is refused. Returns what was seen; raises on a leak."""
    model = server.model
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                 limits=httpx.Limits(max_connections=server.capacity + 1)) as client:
        holders = [asyncio.create_task(_hold(client, model, i)) for i in range(server.capacity)]
        try:
            deadline = time.monotonic() + timeout
            while True:
                done = [task for task in holders if task.done()]
                if done:
                    raise AssertionError(f"a capacity request ended early: {done[0].result()}")
                values = await asyncio.to_thread(metrics, server.base_url)
                running = values["ninfer:num_requests_running"]
                waiting = values["ninfer:num_requests_waiting"]
                if running == server.max_concurrency and waiting == server.max_pending_requests:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"capacity requests not all placed: running {running}, waiting {waiting}")
                await asyncio.sleep(0.05)
            extra = await client.post(PATHS["chat"], json=body("chat", model, "one too many", 1, False))
            if extra.status_code != 429:
                raise AssertionError(f"a request beyond capacity got {extra.status_code}, not 429")
            return {"placed": server.capacity, "beyond_capacity_status": extra.status_code}
        finally:
            for task in holders:
                task.cancel()  # closes the connections: the server cancels the held requests
            await asyncio.gather(*holders, return_exceptions=True)


async def _hold(client: httpx.AsyncClient, model: str, i: int) -> str:
    payload = body("chat", model, f"hold the lane {i}", CAPACITY_HOLD_TOKENS, True, temperature=0)
    async with client.stream("POST", PATHS["chat"], json=payload) as response:
        if response.status_code != 200:
            return f"{response.status_code} {(await response.aread())[:200]!r}"
        async for _ in response.aiter_bytes():
            pass
    return "finished"


async def check_whole_kv_pool(server: Server) -> dict:
    """A request reserving every KV page is admitted (module docstring), then dropped."""
    messages = [{"role": "user", "content": "take every page"}]
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
        counted = await client.post("/v1/messages/count_tokens", json={"model": server.model, "messages": messages})
        prompt_tokens = counted.json()["input_tokens"]
        payload = {"model": server.model, "messages": messages, "stream": True,
                   "max_tokens": server.limits["max_context"] - prompt_tokens}
        async with client.stream("POST", PATHS["messages"], json=payload) as response:
            status = response.status_code  # a stream answers at admission; leaving closes it
    if status != 200:
        raise AssertionError(f"a request reserving the whole KV pool got {status}: KV pages leaked")
    return {"kv_pages": server.limits["kv_pages"], "status": status}


def rising(readings: list[dict[str, int]]) -> list[str]:
    """Gauges that rose from every reading to the next (at least three rises: the cache's own
    variation is a step up or down, a leak is a rise every round)."""
    if len(readings) < 4:
        return []
    return [name for name in POOL_GAUGES
            if all(later[name] > earlier[name] for earlier, later in itertools.pairwise(readings))]


def _flush_conversations(server: Server) -> int:
    limits = server.limits
    return limits["max_private_continuations"] + limits["max_shared_prefixes"] + 1


async def pool_gauges(server: Server) -> dict[str, int]:
    """The engine's pool gauges during a fixed probe, after fixed flush conversations (module docstring)."""
    await settle(server)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
        for i in range(_flush_conversations(server)):
            payload = body("chat", server.model, f"flush conversation number {i:03d}", FLUSH_MAX_TOKENS, False,
                           temperature=0)
            response = await client.post(PATHS["chat"], json=payload)
            response.raise_for_status()
        probe_starts = len(server.read_log())
        payload = body("chat", server.model, "the accounting probe", PROBE_MAX_TOKENS, False, temperature=0)
        (await client.post(PATHS["chat"], json=payload)).raise_for_status()
    await asyncio.sleep(2 * STATS_INTERVAL_MS / 1000)
    decoding = [r for r in server.read_log()[probe_starts:] if r["event"] == "throughput" and r["running"] == 1
                and r["waiting"] == 0 and r["prefill_tokens"] == 0 and r["decode_tokens"] > 0]
    if not decoding:
        raise AssertionError("no throughput record of the probe's decode: is the model too fast for the interval?")
    return {name: decoding[-1][name] for name in POOL_GAUGES}


async def round_checks(server: Server, number: int, problems: list[str]) -> dict:
    """The accounting checks after a round (module docstring); a failed one is added to problems."""
    checks: dict = {}
    for name, check in (("settle", settle), ("capacity", check_capacity), ("whole_kv_pool", check_whole_kv_pool),
                        ("gauges", pool_gauges)):
        try:
            checks[name] = await check(server)
        except AssertionError as exc:
            checks[name] = f"failed: {exc}"
            problems.append(f"round {number}: {name}: {exc}")
    checks["rss_mib"] = server.rss_mib()
    return checks


def judge_growth(report: dict, rss_growth_mib: float) -> None:
    """RSS from the end of the first round to the end of the last, and gauges rising every round."""
    rounds = report["rounds"]
    first, last = rounds[0]["rss_mib"], rounds[-1]["rss_mib"]
    report["rss_growth_mib"] = {p: round(last[p] - first[p], 1) for p in ("api", "engine")}
    for process, growth in report["rss_growth_mib"].items():
        if growth > rss_growth_mib:
            report["problems"].append(f"{process} RSS grew {first[process]:.1f} -> {last[process]:.1f} MiB")
    readings = [report["baseline_gauges"], *(r["gauges"] for r in rounds if isinstance(r["gauges"], dict))]
    if names := rising(readings):
        report["problems"].append(f"pool gauges rose after every round: {names}")


def write_report(out: Path, name: str, report: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
