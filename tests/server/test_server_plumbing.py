"""Transport details: SSE heartbeat, TCP options on accepted connections, start-up option checks."""

from __future__ import annotations

import asyncio
import socket
import sys

import pytest

from ninfer.cli import add_serve_options, serve_config
from ninfer.config import ConfigValueError
from ninfer.server.api_process import TCP_USER_TIMEOUT_MS, listen_socket
from ninfer.server.sse import KEEPALIVE_FRAME, with_keepalive


def test_keepalive_comment_after_silence_and_inner_stream_closed_on_exit():
    closed = asyncio.Event()

    async def slow_frames():
        try:
            yield b"data: 1\n\n"
            await asyncio.sleep(0.35)
            yield b"data: 2\n\n"
            await asyncio.sleep(10)
            yield b"data: never\n\n"
        finally:
            closed.set()

    async def scenario():
        out = []
        stream = with_keepalive(slow_frames(), interval=0.1)
        async for frame in stream:
            out.append(frame)
            if frame == b"data: 2\n\n":
                break
        await stream.aclose()
        return out

    frames = asyncio.run(scenario())
    assert frames[0] == b"data: 1\n\n" and frames[-1] == b"data: 2\n\n"
    assert 2 <= frames.count(KEEPALIVE_FRAME) <= 4
    assert closed.is_set()  # leaving the stream (a disconnect) closes the producer, which aborts the request


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_USER_TIMEOUT is Linux-only")
def test_accepted_connections_inherit_keepalive_and_user_timeout():
    server = listen_socket("127.0.0.1", 0)
    try:
        client = socket.create_connection(server.getsockname())
        server.setblocking(True)
        conn, _ = server.accept()
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == TCP_USER_TIMEOUT_MS
        conn.close()
        client.close()
    finally:
        server.close()


def parse(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_options(parser)
    return serve_config(parser.parse_args(list(argv)))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-concurrency", "9"], "--max-concurrency"),
        (["--max-context", "1"], "--max-context"),
        (["--temperature", "2.5"], "--temperature"),
        (["--top-k", "21"], "--top-k"),
        (["--default-thinking-budget", "0"], "--default-thinking-budget"),
        (["--no-prefix-reuse", "--device-state-slots", "0"], "--no-prefix-reuse cannot be combined with --device"),
        (["--no-prefix-reuse", "--host-state-slots", "0"], "--no-prefix-reuse cannot be combined with --host-state"),
        (["--no-prefix-reuse", "--max-long-anchors-per-continuation", "0"], "with --max-long-anchors"),
        (["--no-prefix-reuse", "--max-private-continuations", "0"], "with --max-private-continuations"),
        (["--no-prefix-reuse", "--max-shared-prefixes", "4"], "with --max-shared-prefixes"),
        (["--no-prefix-reuse", "--host-kv-mib", "0"], "with --host-kv-mib"),
        (["--context-cost-presets", "/nonexistent/costs.json"], "--context-cost-presets /nonexistent/costs.json: cannot read"),
        (["--port", "0"], "--port"),
        (["--prefill-chunk", "0"], "--prefill-chunk"),
    ],
)
def test_invalid_options_fail_at_start_up_naming_the_option(argv, message):
    with pytest.raises(ConfigValueError, match=message):
        parse(*argv)


def test_options_reach_the_config():
    config, kv_auto = parse("model-dir", "--max-concurrency", "4", "--kv-capacity", "auto", "--greedy",
                            "--model-id", "alias", "--device-state-slots", "3", "--seed", "-7")
    assert config.artifact == "model-dir" and config.model_id == "alias" and config.greedy
    assert kv_auto and config.engine.kv_capacity is None
    assert config.engine.max_concurrency == 4 and config.engine.num_state_slots == 7
    assert config.engine.num_host_state_slots == 8  # the default pinned host tier
    assert parse("--host-state-slots", "0")[0].engine.num_host_state_slots == 0
    assert parse("--no-prefix-reuse")[0].engine.num_host_state_slots == 0
    engine = parse()[0].engine
    assert (engine.num_long_anchors, engine.num_private_continuations, engine.num_shared_prefixes) == (2, 2, 4)
    engine = parse("--max-concurrency", "6")[0].engine
    assert (engine.num_private_continuations, engine.num_shared_prefixes) == (12, 6)
    assert parse()[0].engine.host_kv_bytes == 8192 << 20
    assert parse("--host-kv-mib", "64")[0].engine.host_kv_bytes == 64 << 20
    engine = parse("--no-prefix-reuse")[0].engine
    assert engine.host_kv_bytes == 0
    assert (engine.num_long_anchors, engine.num_private_continuations, engine.num_shared_prefixes) == (0, 0, 0)
    engine = parse("--max-long-anchors-per-continuation", "1", "--max-private-continuations", "3",
                   "--max-shared-prefixes", "0")[0].engine
    assert (engine.num_long_anchors, engine.num_private_continuations, engine.num_shared_prefixes) == (1, 3, 0)
    assert config.sampling.seed == -7
    default, _ = parse()
    assert default.engine.max_context == 8192 and default.engine.kv_tokens == 8192
    assert default.default_max_tokens == 8192 and default.port == 8080 and default.host == "127.0.0.1"
