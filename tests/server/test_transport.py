"""HTTP transport under hostile clients: trickled headers, oversized headers, pipelining, idle
keep-alive connections, API-key comparison and CORS defaults."""

from __future__ import annotations

import hmac
import inspect
import socket
import time

import httpx
import pytest

import ninfer.server.middleware as middleware
from ninfer.server.http_protocol import GuardedHttpProtocol
from tests.server.conftest import serve_config, start_server


@pytest.fixture(scope="module")
def server(tiny_qwen):
    guards = (GuardedHttpProtocol.header_timeout_s, GuardedHttpProtocol.max_header_bytes)
    GuardedHttpProtocol.header_timeout_s = 1.0  # short, so a trickling client is caught in a test
    running = start_server(serve_config(tiny_qwen, max_concurrency=1, max_context=256))
    yield running
    running.stop()
    GuardedHttpProtocol.header_timeout_s, GuardedHttpProtocol.max_header_bytes = guards


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(10)
    return sock


def read_all(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def test_a_client_trickling_header_lines_is_cut_off_at_the_header_deadline(server):
    sock = connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    started = time.monotonic()
    answer = b""
    for _ in range(40):  # a header line every 0.1 s, never the blank line that ends them
        try:
            sock.sendall(b"X-Slow: 1\r\n")
        except (BrokenPipeError, ConnectionResetError):
            break
        time.sleep(0.1)
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
    assert time.monotonic() - started < 3.0
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # everyone else is served


def test_oversized_headers_get_431_and_nothing_of_the_request_runs(server):
    sock = connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (200 << 10) + b"\r\n\r\n")
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:80]
    assert b'"status"' not in answer  # the health handler never ran
    normal = httpx.get(f"{server.base_url}/health", headers={"X-Fine": "a" * 4000})
    assert normal.status_code == 200


def test_pipelined_requests_are_answered_in_order(server):
    sock = connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answer = read_all(sock)
    assert answer.count(b"HTTP/1.1 200 ") == 2
    assert answer.index(b'"status"') < answer.index(b'"data"')


def test_an_idle_kept_alive_connection_is_closed_by_the_server(tiny_qwen):
    import ninfer.server.api_process as server_module

    keep_alive = server_module.KEEP_ALIVE_S
    server_module.KEEP_ALIVE_S = 0.5
    running = start_server(serve_config(tiny_qwen, max_concurrency=1, max_context=256))
    try:
        sock = connect(running)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b"}" not in first:  # the whole small response: headers and JSON body
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        started = time.monotonic()
        assert sock.recv(10) == b""  # closed by the server after the keep-alive timeout
        assert time.monotonic() - started < 5
    finally:
        server_module.KEEP_ALIVE_S = keep_alive
        running.stop()


def test_the_api_key_is_compared_in_constant_time():
    # The comparison must not stop at the first differing byte: hmac.compare_digest does not.
    source = inspect.getsource(middleware)
    assert "compare_digest" in source and "==" not in _key_comparison_lines(source)
    secret = b"k" * 64
    guesses = {"first byte wrong": b"x" + secret[1:], "last byte wrong": secret[:-1] + b"x"}
    samples: dict[str, list[int]] = {name: [] for name in guesses}
    # The two guesses alternate sample by sample, so a neighbour's burst of load lands on both.
    for _ in range(15):
        for name, guess in guesses.items():
            started = time.perf_counter_ns()
            for _ in range(20000):
                hmac.compare_digest(guess, secret)
            samples[name].append(time.perf_counter_ns() - started)
    timings = {name: sorted(values)[len(values) // 2] for name, values in samples.items()}
    ratio = timings["first byte wrong"] / timings["last byte wrong"]
    assert 0.7 < ratio < 1.4, timings


def _key_comparison_lines(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if "api_key" in line and ("if " in line or "return " in line))


def test_cors_is_off_by_default(server):
    preflight = httpx.options(
        f"{server.base_url}/v1/chat/completions",
        headers={"Origin": "https://example.com", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers
    plain = httpx.get(f"{server.base_url}/health", headers={"Origin": "https://example.com"})
    assert "access-control-allow-origin" not in plain.headers
