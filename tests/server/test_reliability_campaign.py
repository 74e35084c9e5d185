"""Reliability under overload, vanishing clients and a flooded response store: bounded CI runs of
benchmarks/reliability/{soak,disconnect_storm,store_flood}.py against a server process, the same
traffic against an in-process server whose pools, waiting room and store are read directly, and
the regression tests of what those runs found."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from ninfer.server.openai_responses.store import ResponseStore, StoredResponse
from tests.net import load_script
from tests.server.conftest import RunningServer, serve_config, start_server, wait_until


def load(name: str):
    """A script of benchmarks/reliability (each puts its folder on sys.path for harness.py)."""
    return load_script(f"benchmarks/reliability/{name}.py", f"reliability_{name}")


def assert_pools_hold_only_checkpoints(server: RunningServer) -> None:
    """Nothing runs or waits, no waiting-room place is taken, and every KV page, state slot, host
    state slot and host KV page in use is held by a cached checkpoint, as many times as it is used."""
    wait_until(lambda: server.serving.engine.num_outstanding == 0, what="every waiting-room place back")
    core = server.core
    wait_until(lambda: not core.pool_accounting()["running"] and not core.pool_accounting()["waiting"],
               what="an idle engine")
    checkpoints = list(core.cache.checkpoints.values())
    pages = Counter(page for ck in checkpoints for page in ck.pages)
    assert core.kv_pool.num_used == len(pages)
    assert all(core.kv_pool.refcount(page) == count for page, count in pages.items())
    slots = [ck.state_slot for ck in checkpoints if ck.state_slot is not None]
    assert core.state_pool.num_slots - core.state_pool.num_free == len(set(slots)) == len(slots)
    host_slots = [ck.host_slot for ck in checkpoints if ck.host_slot is not None]
    host_pool = core.cache.host_pool
    assert host_pool.num_slots - host_pool.num_free == len(set(host_slots)) == len(host_slots)
    host_pages = Counter(page for ck in checkpoints for page in ck.host_pages or [])
    host_kv = core.cache.host_kv_pool
    assert (host_kv.num_used if host_kv else 0) == len(host_pages)
    core.kv_pool.check_balanced()
    core.state_pool.check_balanced()


def request_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- what the runs found ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_server(tiny_qwen) -> RunningServer:
    server = start_server(serve_config(tiny_qwen, max_concurrency=2, max_pending_requests=4, default_max_tokens=8))
    yield server
    server.stop()


@pytest.mark.parametrize("close", ["fin", "rst"])
def test_a_client_gone_while_its_body_is_read_is_not_an_internal_error(small_server, caplog, close):
    body = json.dumps({"messages": [{"role": "user", "content": "half of me"}], "max_tokens": 4}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with caplog.at_level(logging.INFO):
        with socket.create_connection(("127.0.0.1", small_server.port)) as sock:
            sock.sendall(head + body[: len(body) // 2])
            time.sleep(0.2)  # the server is reading the body
            if close == "rst":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        wait_until(lambda: any(r.name.startswith("ninfer") and "on /v1/chat/completions" in r.getMessage()
                               or "client disconnected" in r.getMessage() for r in caplog.records), 10, "the disconnect")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert small_server.serving.engine.num_outstanding == 0
    response = httpx.post(small_server.base_url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "still here?"}], "max_tokens": 2})
    assert response.status_code == 200


# ---- the store at its limits ------------------------------------------------------------------------
def stored(response_id: str, text_bytes: int) -> StoredResponse:
    item = {"id": f"msg_{response_id}", "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "x" * text_bytes}]}
    response = {"id": response_id, "object": "response", "status": "completed", "output": []}
    return StoredResponse(response, [item], [item], len(json.dumps(item)), None, None)


def test_the_store_stays_within_its_limits_and_evicts_least_recently_used_first_under_threads():
    store = ResponseStore(max_records=50, max_bytes=40_000)
    evicted: list[str] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for i in range(400):
            key = f"resp_{seed}_{i}"
            gone = store.put(stored(key, rng.randint(10, 2_000)))
            with lock:
                evicted.extend(gone)
            store.get(f"resp_{seed}_{rng.randrange(i + 1)}")
            if rng.random() < 0.1:
                store.delete(f"resp_{seed}_{rng.randrange(i + 1)}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    records = list(store._records.values())
    assert len(records) <= store.max_records and store.used_bytes <= store.max_bytes
    assert store.used_bytes == sum(record.size for record in records)
    assert evicted and not {record.id for record in records} & set(evicted)  # ids are never reused

    # Single-threaded order: the least recently used record goes first, a touched one stays.
    lru = ResponseStore(max_records=3, max_bytes=1 << 20)
    for key in ("a", "b", "c"):
        lru.put(stored(key, 10))
    lru.get("a")
    assert lru.put(stored("d", 10)) == ["b"]
    assert lru.put(stored("e", 10)) == ["c"]
    assert [record.id for record in lru._records.values()] == ["a", "d", "e"]


@pytest.mark.slow  # ~250 Responses requests on the CPU: about 30 s on 2 cores
def test_store_flood_in_process_keeps_the_store_within_its_byte_budget(tiny_qwen):
    flood_script = load("store_flood")
    server = start_server(serve_config(tiny_qwen, max_concurrency=2, max_pending_requests=30, max_context=8192,
                                       response_store_max_records=64, response_store_max_mib=1))
    store = server.serving.response_store

    async def run() -> tuple[dict, dict, list[str]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            flood = flood_script.Flood(SimpleNamespace(model=server.serving.model_id), client, store.max_records)
            await flood.lru()
            chain = await flood.chain(100)
            burst = await flood.flood(8, 5.0, random.Random(0))
            return chain, burst, flood.problems

    try:
        chain, burst, problems = asyncio.run(run())
        assert problems == []
        assert chain["depth"] == 100 and 0 < chain["oldest_retained_turn"]  # the MiB limit evicted early links
        assert burst["continued_after"] > 0
        records = list(store._records.values())
        assert len(records) <= store.max_records and store.used_bytes <= store.max_bytes
        assert store.used_bytes == sum(record.size for record in records)
        assert_pools_hold_only_checkpoints(server)
    finally:
        server.stop()


@pytest.mark.slow  # a server process, a 60-deep chain and an 8 s flood: about 35 s on 2 cores
def test_store_flood_script_meets_its_bounds(tiny_qwen, tmp_path):
    argv = ["--artifact", tiny_qwen, "--depth", "60", "--seconds", "8", "--rounds", "1", "--out", str(tmp_path)]
    assert load("store_flood").main(argv) == 0
    report = json.loads((tmp_path / "store_flood.json").read_text())
    assert report["problems"] == [] and report["requests"] > 300


# ---- disconnect storm -------------------------------------------------------------------------------
@pytest.mark.slow  # 100 vanishing clients against an in-process server: about 25 s on 2 cores
def test_disconnect_storm_in_process_leaks_no_page_slot_place_or_store_entry(tiny_qwen, tmp_path):
    storm_script = load("disconnect_storm")
    log_path = tmp_path / "requests.jsonl"
    server = start_server(serve_config(tiny_qwen, max_concurrency=2, max_pending_requests=8, pending_timeout_ms=5000,
                                       prefill_chunk=8192, request_log_jsonl=str(log_path)))
    try:
        tally = asyncio.run(storm_script.storm(server.port, server.serving.model_id, 100, 10, random.Random(1)))
        assert sum(tally.plans.values()) == 100
        assert_pools_hold_only_checkpoints(server)
        wait_until(lambda: not storm_script.log_terminals(request_log(log_path))[1], what="every terminal logged")
        log = request_log(log_path)
        done_responses = [r for r in log if r["event"] == "request_done" and r["protocol"] == "openai_responses"]
        assert len(server.serving.response_store) == len(done_responses)  # a cancelled Response is never stored
        kinds, _ = storm_script.log_terminals(log)
        assert not [kind for kind in kinds if "internal_error" in kind or "server_error" in kind]
    finally:
        server.stop()


@pytest.mark.slow  # a server process and 100 vanishing clients in one round (the in-process twin reads the pools): ~26 s
def test_disconnect_storm_script_meets_its_bounds(tiny_qwen, tmp_path):
    argv = ["--artifact", tiny_qwen, "--clients", "100", "--rounds", "1", "--out", str(tmp_path)]
    assert load("disconnect_storm").main(argv) == 0


# ---- overload soak ----------------------------------------------------------------------------------
@pytest.mark.slow  # 60 clients for 10 s against an in-process server: about 15 s on 2 cores
def test_overload_in_process_refuses_only_by_protocol_and_returns_every_place_and_page(tiny_qwen):
    soak_script = load("soak")
    server = start_server(serve_config(tiny_qwen, max_concurrency=2, max_pending_requests=4, pending_timeout_ms=1500,
                                       prefill_chunk=8192))
    try:
        target = SimpleNamespace(base_url=server.base_url, model=server.serving.model_id)
        tally = asyncio.run(soak_script.load_round(target, 10 * 6, 10.0, random.Random(2)))
        assert tally.failures == []
        assert tally.statuses["200"] > 0 and tally.statuses["429"] > 0
        assert_pools_hold_only_checkpoints(server)
    finally:
        server.stop()


@pytest.mark.slow  # 100 clients for 12 s against a server process, one round, then the checks: about 30 s on 2 cores
def test_overload_soak_script_meets_its_bounds(tiny_qwen, tmp_path):
    argv = ["--artifact", tiny_qwen, "--minutes", "0.2", "--rounds", "1", "--out", str(tmp_path)]
    assert load("soak").main(argv) == 0
    report = json.loads((tmp_path / "soak.json").read_text())
    statuses = Counter()
    for number in report["rounds"]:
        statuses.update(number["statuses"])
    assert statuses["200"] > 0 and statuses["429"] > 0
    assert set(statuses) <= {"200", "429", "503", "504", "529"}
