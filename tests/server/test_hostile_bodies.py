"""Hand-made hostile bodies against a real server: each is refused with a 4xx that names the
field where one exists (or served, where JSON allows it), never a 5xx, and the server stays up.

The fuzz campaign (benchmarks/reliability/fuzz.py) sends the same cases to ninfer-serve on the
embedded model; these are its regression tests, on the tiny Qwen artifact.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from ninfer.server import middleware
from tests.server.conftest import RunningServer, serve_config, start_server

BODY_ENDPOINTS = [
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/responses/input_tokens",
    "/v1/messages",
    "/v1/messages/count_tokens",
]
STALL_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tiny_qwen) -> Iterator[RunningServer]:
    # A short silence limit so the stalled-body case takes a second; the limit is read at app creation.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(middleware, "BODY_IDLE_TIMEOUT_S", STALL_TIMEOUT_S)
        # max_context bounds the generation a 10**1000 output limit is clamped to.
        running = start_server(serve_config(tiny_qwen, default_max_tokens=2, max_request_mib=16, max_context=128))
    yield running
    running.stop()


def post(server: RunningServer, path: str, content: bytes, content_type: str | None = "application/json"):
    headers = {"content-type": content_type} if content_type else {}
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=120)


def valid_body(server: RunningServer, path: str) -> dict:
    if path.startswith("/v1/messages"):
        return {"model": "any", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    if path.startswith("/v1/responses"):
        return {"model": server.serving.model_id, "input": "Hi", **({} if "input_tokens" in path else {"max_output_tokens": 2})}
    return {"model": server.serving.model_id, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}


def error_of(response: httpx.Response) -> tuple[int, str | None, str | None, str]:
    """(status, code, param, message); Anthropic bodies carry no code or param."""
    body = response.json()
    error = body["error"]
    return response.status_code, error.get("code"), error.get("param"), error["message"]


def spliced(server: RunningServer, path: str, key: str, literal: str) -> bytes:
    """A valid body whose `key` holds a raw JSON literal (one json.dumps cannot write)."""
    body = valid_body(server, path)
    body[key] = "@@"
    return httpx.Request("POST", "/", json=body).content.replace(b'"@@"', literal.encode())


@pytest.mark.parametrize("path", BODY_ENDPOINTS)
def test_ten_thousand_levels_of_nesting_are_invalid_json(server, path):
    response = post(server, path, b"[" * 10_000 + b"]" * 10_000)
    assert response.status_code == 400, response.text
    assert "nests deeper than 128 levels" in response.json()["error"]["message"]


def test_nesting_inside_a_field_names_the_field(server):
    body = spliced(server, "/v1/chat/completions", "metadata", '{"a": ' * 200 + "1" + "}" * 200)
    assert error_of(post(server, "/v1/chat/completions", body))[:3] == (400, "invalid_json", "metadata")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_non_finite_numbers_are_refused_naming_the_field(server, path, literal):
    # client_metadata/metadata are never range-checked: before, a NaN there reached the JSON encoder (500).
    key = "client_metadata" if path == "/v1/responses" else "metadata"
    body = spliced(server, path, key, '{"x": [%s]}' % literal)
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith(f"{key}.x[0] is NaN or infinite")


def test_hosted_tool_echo_with_nan_is_refused_not_a_500(server):
    # The Response echoes its tools; a NaN there used to fail the JSON encoder after generation.
    body = spliced(server, "/v1/responses", "tools", '[{"type": "web_search", "x": NaN}]')
    assert error_of(post(server, "/v1/responses", body))[:3] == (400, "invalid_value", "tools[0].x")


def test_huge_integer_literals(server):
    path = "/v1/chat/completions"
    assert error_of(post(server, path, spliced(server, path, "seed", "1" + "0" * 1000)))[:3] == (
        400, "invalid_value", "seed")
    # 10**1000 is a valid JSON integer; as an output limit it is clamped to the context like any large one.
    assert post(server, path, spliced(server, path, "max_tokens", "1" + "0" * 1000)).status_code == 200
    # Past Python's 4300-digit conversion limit json.loads raises ValueError, not JSONDecodeError (was a 500).
    assert error_of(post(server, path, spliced(server, path, "seed", "9" * 5000)))[:2] == (400, "invalid_json")


@pytest.mark.parametrize(
    ("path", "field"),
    [("/v1/chat/completions", "max_tokens"), ("/v1/responses", "max_output_tokens"), ("/v1/messages", "max_tokens")],
)
def test_huge_output_limits_reach_the_engine_process_encodable(server, path, field, monkeypatch):
    """An output limit past int64 (the fuzz found 10**36 on Responses: the engine-process message
    could not be encoded, a 500) is clamped like any limit past the context."""
    from ninfer.contract.messages import AddRequest, encode

    engine = server.serving.engine
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda request: (encode(AddRequest(request)), generate(request))[1])
    for literal in ("1" + "0" * 36, "1" + "0" * 1000):
        assert post(server, path, spliced(server, path, field, literal)).status_code == 200, literal


@pytest.mark.parametrize("path", BODY_ENDPOINTS)
def test_invalid_utf8_is_invalid_json(server, path):
    body = spliced(server, path, "user", '"\xff"').replace("\xff".encode(), b"\xff\xfe")
    response = post(server, path, body)
    assert response.status_code == 400 and "not valid UTF-8" in response.json()["error"]["message"]
    # An encoded surrogate (ED A0 80) is not UTF-8 either; json.loads(bytes) used to let it through.
    response = post(server, path, body.replace(b"\xff\xfe", b"\xed\xa0\x80"))
    assert response.status_code == 400 and "not valid UTF-8" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", BODY_ENDPOINTS)
def test_lone_surrogates_are_refused_naming_the_field(server, path):
    body = valid_body(server, path)
    key = "input" if path.startswith("/v1/responses") else "messages"
    raw = httpx.Request("POST", "/", json=body).content.replace(b'"Hi"', b'"a\\ud800b"')
    response = post(server, path, raw)
    assert response.status_code == 400, response.text
    prefix = f"{key}[0].content" if key == "messages" else key
    assert response.json()["error"]["message"].startswith(f"{prefix} holds a lone UTF-16 surrogate")
    # A surrogate pair is one character and is served.
    paired = raw.replace(b"\\ud800", b"\\ud83d\\ude00")
    assert post(server, path, paired).status_code == 200


@pytest.mark.slow  # tokenizes 10 MB
def test_ten_megabyte_string_is_refused_as_too_long_and_not_echoed(server):
    path = "/v1/chat/completions"
    huge = "word " * (2 << 20)
    body = valid_body(server, path) | {"messages": [{"role": "user", "content": huge}]}
    assert error_of(httpx.post(server.base_url + path, json=body, timeout=300))[:3] == (
        400, "context_length_exceeded", "messages")
    response = httpx.post(server.base_url + path, json=valid_body(server, path) | {"reasoning_effort": huge})
    status, code, param, message = error_of(response)
    assert (status, code, param) == (400, "invalid_value", "reasoning_effort")
    assert len(response.content) < 2000, "the error echoes the 10 MB value"


def test_duplicate_keys_keep_the_last_value(server):
    path = "/v1/chat/completions"
    body = spliced(server, path, "max_tokens", '1, "max_tokens": -1')
    assert error_of(post(server, path, body))[:3] == (400, "invalid_value", "max_tokens")
    body = spliced(server, path, "max_tokens", '-1, "max_tokens": 1')
    assert post(server, path, body).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_the_body_is_json_whatever_the_content_type(server, content_type):
    path = "/v1/chat/completions"
    ok = httpx.Request("POST", "/", json=valid_body(server, path)).content
    assert post(server, path, ok, content_type).status_code == 200
    assert error_of(post(server, path, b"model=x&messages=y", content_type))[:2] == (400, "invalid_json")


def test_multipart_form_data_is_invalid_json(server):
    response = httpx.post(server.base_url + "/v1/messages", files={"file": ("a.txt", b"hello")})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("the request body is not valid JSON")


@pytest.mark.parametrize("path", BODY_ENDPOINTS)
@pytest.mark.parametrize("raw", [b"", b"[]", b"1", b"null", b'"text"'])
def test_empty_and_non_object_bodies(server, path, raw):
    response = post(server, path, raw)
    assert response.status_code == 400
    expected = "the request body is not valid JSON" if raw == b"" else "the request body must be a JSON object"
    assert response.json()["error"]["message"].startswith(expected)


def _raw_request(server: RunningServer, head: bytes, chunks: list[bytes], wait_s: float) -> bytes:
    """Send a request head and body pieces, then stall; what the server answers within wait_s."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait_s) as sock:
        sock.sendall(head)
        for chunk in chunks:
            sock.sendall(chunk)
        answer = b""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                piece = sock.recv(65536)
            except TimeoutError:
                break
            if not piece:
                break
            answer += piece
        return answer


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_body_that_stalls_times_out(server, path):
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    started = time.monotonic()
    answer = _raw_request(server, head.encode(), [b"5\r\n{\"mod\r\n"], wait_s=STALL_TIMEOUT_S + 10)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request body stalled" in answer
    assert time.monotonic() - started < STALL_TIMEOUT_S + 5
    # Content-Length bodies that stop short stall the same way.
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
    assert _raw_request(server, head.encode(), [b'{"mod'], wait_s=STALL_TIMEOUT_S + 10).startswith(b"HTTP/1.1 408")
    assert httpx.get(server.base_url + "/health").status_code == 200


@pytest.mark.slow  # uploads 16 MiB
def test_a_chunked_body_over_the_limit_is_413_not_500(server):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    piece = b"x" * (1 << 20)
    # 16 MiB and a bit, then silence: the server has read everything sent when it answers and closes.
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * 16 + [b"400\r\n" + b"x" * 1024 + b"\r\n"]
    answer = _raw_request(server, head, chunks, wait_s=30)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"request_too_large" in answer
