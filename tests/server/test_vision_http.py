"""Images end to end through a real server (--vision) and the official SDKs, on the tiny random
Qwen3.5 VL artifact: Chat (stream and not), Responses (with input_tokens), Anthropic Messages
(base64, inside a tool_result, count_tokens), prompt reuse across turns, media errors naming
their field, and the SSRF refusal of loopback URLs with its opt-in.
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import socket
import threading
import time

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.server.conftest import serve_config, start_server, wait_until
from tests.server.test_request_log import VALIDATOR, Collect

IMAGE_TOKENS = 72  # 300x260 px -> 288x256 -> 18x16 patches -> 72 merged tokens
TEMPLATE_TOKENS = 3  # <|vision_start|><|image_pad|><|vision_end|>


def png_bytes(seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (260, 300, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(seed: int = 0) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(seed)).decode()


@pytest.fixture(scope="module")
def vl_artifact(artifact_root) -> str:
    return str(make_tiny_qwen3_5(artifact_root, vision=True))


@pytest.fixture(scope="module")
def server(vl_artifact):
    running = start_server(serve_config(vl_artifact, vision=True, max_concurrency=2, default_max_tokens=8))
    yield running
    running.stop()


def sdk(server) -> openai.OpenAI:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    client.model_id = server.serving.model_id
    return client


def chat(client, content, **kwargs):
    return client.chat.completions.create(
        model=client.model_id, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=6, **kwargs
    )


def test_the_served_openapi_document_is_the_vision_one(server):
    from ninfer.server.openapi import openapi_document

    document = httpx.get(server.base_url + "/openapi.json").json()
    assert document == openapi_document(vision=True) and "ChatImagePart" in document["components"]["schemas"]


def test_chat_with_an_image_streams_what_it_answers_and_counts_the_image_tokens(server):
    client = sdk(server)
    image = {"type": "image_url", "image_url": {"url": data_url()}}
    answer = chat(client, [image, {"type": "text", "text": "What is this?"}])
    text_only = chat(client, [{"type": "text", "text": "What is this?"}])
    assert answer.usage.prompt_tokens - text_only.usage.prompt_tokens == TEMPLATE_TOKENS + IMAGE_TOKENS - 1
    streamed = chat(client, [image, {"type": "text", "text": "What is this?"}], stream=True,
                    stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == answer.usage.prompt_tokens


def test_a_follow_up_turn_reuses_the_prompt_through_the_image(server):
    client = sdk(server)
    image = {"type": "image_url", "image_url": {"url": data_url(1)}}
    first = [{"role": "user", "content": [image, {"type": "text", "text": "Describe it."}]}]
    one = client.chat.completions.create(model=client.model_id, messages=first, temperature=0, max_tokens=5)
    second = first + [
        {"role": "assistant", "content": one.choices[0].message.content},
        {"role": "user", "content": "And the colours?"},
    ]
    two = client.chat.completions.create(model=client.model_id, messages=second, temperature=0, max_tokens=5)
    assert two.usage.prompt_tokens_details.cached_tokens > IMAGE_TOKENS


def test_responses_input_image_and_its_input_tokens_count(server):
    client = sdk(server)
    content = [{"type": "input_image", "image_url": data_url(2)}, {"type": "input_text", "text": "Caption?"}]
    response = client.responses.create(
        model=client.model_id, input=[{"role": "user", "content": content}], temperature=0, max_output_tokens=5
    )
    counted = httpx.post(server.base_url + "/v1/responses/input_tokens",
                         json={"model": client.model_id, "input": [{"role": "user", "content": content}]}).json()
    assert counted["input_tokens"] == response.usage.input_tokens
    items = client.responses.input_items.list(response.id)
    assert items.data[0].content[0].type == "input_image"


def test_anthropic_image_blocks_in_user_content_and_tool_results(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x")
    model = server.serving.model_id
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png_bytes(3)).decode()}
    messages = [
        {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "Look."}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {"p": "a.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "image", "source": source}]}]},
    ]
    tools = [{"name": "read", "description": "read a file", "input_schema": {"type": "object"}}]
    reply = client.messages.create(model=model, max_tokens=5, messages=messages, tools=tools)
    counted = client.messages.count_tokens(model=model, messages=messages, tools=tools)
    assert counted.input_tokens == reply.usage.input_tokens
    assert reply.usage.input_tokens > 2 * IMAGE_TOKENS


@pytest.mark.parametrize(
    ("url", "status", "code"),
    [
        ("data:image/png;base64,@@@", 400, "invalid_media"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), 400, "invalid_media"),
        ("data:text/plain;base64,aGk=", 400, "invalid_media"),
    ],
)
def test_bad_media_names_its_field(server, url, status, code):
    body = {"model": server.serving.model_id,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == "messages[0].content[0].image_url.url"


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        if self.path.startswith("/slow"):
            time.sleep(3)
        data = png_bytes(4)
        self.send_response(200)
        self.send_header("content-type", "image/png")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_site():
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{site.server_address[1]}/cat.png?token=secret"
    site.shutdown()


def test_a_client_gone_while_its_media_is_fetched_gives_its_place_back(vl_artifact, image_site):
    slow = image_site.replace("/cat.png", "/slow.png")
    running = start_server(serve_config(vl_artifact, vision=True, media_allow_private_networks=True))
    try:
        body = json.dumps({"model": running.serving.model_id, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": slow}}]}]}).encode()
        with socket.create_connection(("127.0.0.1", running.port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            wait_until(lambda: running.serving.engine.num_outstanding == 1, what="the request to take its place")
        # Gone long before the 3 s fetch ends: the place is back as soon as the server sees it.
        wait_until(lambda: running.serving.engine.num_outstanding == 0, timeout=2.5, what="the place to return")
    finally:
        running.stop()


def test_a_loopback_url_is_refused_by_default_and_served_with_the_private_network_opt_in(server, vl_artifact, image_site):
    body = {"model": server.serving.model_id, "max_tokens": 3,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_site}}]}]}
    refused = httpx.post(server.base_url + "/v1/chat/completions", json=body)
    assert refused.status_code == 502
    error = refused.json()["error"]
    assert error["code"] == "media_fetch_failed" and error["param"] == "messages[0].content[0].image_url.url"
    assert "secret" not in error["message"]
    opted = start_server(serve_config(vl_artifact, vision=True, media_allow_private_networks=True))
    try:
        served = httpx.post(opted.base_url + "/v1/chat/completions", json=body)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["prompt_tokens"] > IMAGE_TOKENS
    finally:
        opted.stop()


def test_the_request_log_reports_media_preparation_and_tower_time(vl_artifact, tmp_path):
    log_path = tmp_path / "requests.jsonl"
    running = start_server(serve_config(vl_artifact, vision=True, request_log_jsonl=str(log_path)))
    try:
        client = sdk(running)
        content = [{"type": "image_url", "image_url": {"url": data_url(5)}}, {"type": "text", "text": "Hi"}]
        for _ in range(2):  # the same image twice: a payload-cache hit, then a full-prompt hit
            chat(client, content)
    finally:
        running.stop()
    events = [json.loads(line) for line in log_path.read_text().splitlines()]
    (server_start,) = [e for e in events if e["event"] == "server_start"]
    assert server_start["vision_workspace"]["max_prompt_vision_tokens"] == 32_768
    assert server_start["vision_workspace"]["media_cache_bytes"] == 1024 << 20
    starts = [e for e in events if e["event"] == "request_start"]
    done = [e for e in events if e["event"] == "request_done"]
    assert [s["media"]["items"] for s in starts] == [1, 1]
    assert [(s["media"]["cache_misses"], s["media"]["cache_hits"]) for s in starts] == [(1, 0), (0, 1)]
    assert starts[0]["media"]["payload_bytes"] == 4 * IMAGE_TOKENS * 1536 * 2  # bf16 patches, 4 per token
    assert starts[0]["media"]["preprocess_work_seconds"] > 0
    assert done[0]["timings_seconds"]["vision"] > 0 and done[1]["timings_seconds"]["vision"] == 0


def test_server_start_reports_the_vision_workspace_item_bound_and_hand_off(server):
    collect = Collect()
    server.serving.events.observers.append(collect)
    try:
        server.serving.record_server_start()
    finally:
        server.serving.events.observers.remove(collect)
    (start,) = collect.events
    VALIDATOR.validate(start)
    workspace = start["vision_workspace"]
    # The largest item: an image at 16,777,216 pixels, one token a 32x32 square, four patches a token.
    assert (workspace["max_item_vision_tokens"], workspace["max_item_patches"]) == (16_384, 65_536)
    assert workspace["encode_peak_bytes"] is None  # measured by --kv-capacity auto on CUDA only
    handoff = workspace["handoff"]
    media = server.core.runner.media
    assert handoff["row_bytes"] == media.tower.config.out_hidden_size * media.dtype.itemsize
    assert handoff["capacity_tokens"] == 65_536 and handoff["capacity_bytes"] == 65_536 * handoff["row_bytes"]
    assert handoff["used_tokens"] == 0  # nothing encoded when the engine reported ready


def test_chat_video_url_counts_one_time_stamped_block_per_temporal_patch(server):
    from tests.media.media_samples import video_bytes

    client = sdk(server)
    video = "data:video/mp4;base64," + base64.b64encode(video_bytes(64, 48, fps=10, frame_count=30)).decode()
    with_video = chat(client, [{"type": "video_url", "video_url": {"url": video}}, {"type": "text", "text": "Hi"}])
    text_only = chat(client, [{"type": "text", "text": "Hi"}])
    # 30 frames at 10 fps sampled at 2 fps: 6 frames, 3 temporal patches; each block is its time
    # stamp, <|vision_start|>, 64x64 px -> 4x4 patches -> 4 pads, <|vision_end|>.
    added = with_video.usage.prompt_tokens - text_only.usage.prompt_tokens
    stamps = sum(len(server.serving.artifact.tokenizer.encode(f"<{t:.1f} seconds>")) for t in (0.3, 1.4, 2.6))
    assert added == stamps + 3 * (1 + 4 + 1)


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but whose pixels are one tiny deflate stream."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def _gif_animation() -> bytes:
    frames = [Image.new("RGB", (300, 260), color) for color in ("red", "blue")]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    return out.getvalue()


def _b64(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize(
    ("urls", "status", "code"),
    [
        ([_b64("image/png", _png_header_only(200_000, 200_000))], 400, "media_budget_exceeded"),  # a pixel bomb
        ([_b64("image/png", png_bytes()[:200])], 400, "invalid_media"),  # truncated
        ([_b64("image/svg+xml", b"<svg xmlns='http://www.w3.org/2000/svg'/>")], 400, "invalid_media"),
        ([_b64("image/png", b"")], 400, "invalid_media"),
        ([_b64("image/gif", _gif_animation())], 200, None),  # an animation: its first frame
        ([data_url(9)] * 600, 400, "media_budget_exceeded"),  # 600 x 72 tokens: past the 32,768-token envelope
    ],
)
def test_hostile_images_are_refused_by_code_never_a_500(server, urls, status, code):
    content = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    body = {"model": server.serving.model_id, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == status, response.text[:300]
    if code is not None:
        error = response.json()["error"]
        assert error["code"] == code and error["param"].startswith("messages")
    assert server.serving.engine.num_outstanding == 0


@pytest.mark.slow
def test_ninfer_serve_with_its_engine_process_serves_an_image_and_reuses_it(vl_artifact):
    """The real command: the prepared patches cross to the engine process with the request."""
    import shutil
    import subprocess

    from tests.net import free_port

    if shutil.which("ninfer-serve") is None:
        pytest.skip("ninfer-serve is not installed")
    port = free_port()
    process = subprocess.Popen(["ninfer-serve", vl_artifact, "--vision", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _healthy(base), timeout=120, what="ninfer-serve --vision to be ready")
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        content = [{"type": "image_url", "image_url": {"url": data_url(10)}}, {"type": "text", "text": "What?"}]
        body = {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": content}]}
        first, second = (httpx.post(base + "/v1/chat/completions", json=body, timeout=120) for _ in range(2))
        assert first.status_code == second.status_code == 200
        assert first.json()["usage"]["prompt_tokens"] > IMAGE_TOKENS
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == first.json()["usage"]["prompt_tokens"]
    finally:
        process.terminate()
        process.wait(30)


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
