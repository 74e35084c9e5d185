"""Vision benchmark: the tower's encode time per image and per video, and what a user of
ninfer-serve --vision sees over HTTP: the TTFT of a one-image request and a long conversation
that carries one screenshot in its history.

Encode (in this process, on CUDA): the artifact's tower in bf16 against transformers'
Qwen3_5VisionModel (bf16, its default attention) on the same weights and the same patches. Images
of about 1, 2, 3 and 4 megapixels are PNG-encoded, prepared by the server's own preparation
(decode, smart resize, patch packing; timed on the CPU) and encoded; a 10-second 1280x720 video
sampled as the server samples it (2 frames a second) is encoded from the grid its preparation
yields, its patches random (the time depends on the grid only). Device events, warm-up, median
of --repeats.

Serve (over a socket, OpenAI Chat Completions streamed): ninfer-serve MODEL --vision; TTFT of
one request holding a fresh 1-megapixel image and a short question (each a new image, so the
media cache never hits), then --turns turns of one conversation whose first user message holds
a screenshot: per turn, prompt tokens, cached tokens (usage.prompt_tokens_details) and TTFT.

Writes vision.json and vision.md into --out.

  ninfer write-checkpoint /dev/shm/q27vl --shape 27b --vision
  python3 benchmarks/vision.py --model /dev/shm/q27vl --out /tmp/vision
  python3 benchmarks/vision.py --model DIR --skip-serve       # the encode table only
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels.timing import median_seconds  # noqa: E402
from serve_process import start_server, stop_server, words  # noqa: E402

MEGAPIXELS = (1, 2, 3, 4)
VIDEO_SECONDS, VIDEO_WIDTH, VIDEO_HEIGHT, VIDEO_SOURCE_FPS = 10, 1280, 720, 30


def screenshot_png(megapixels: float, seed: int) -> bytes:
    """A 16:10 screenshot-like image (flat panels, text-like noise rows), PNG-encoded."""
    from PIL import Image

    height = int((megapixels * 1e6 / 1.6) ** 0.5)
    width = int(height * 1.6)
    rng = np.random.default_rng(seed)
    pixels = np.full((height, width, 3), 236, np.uint8)
    pixels[: height // 12] = rng.integers(30, 80, 3, dtype=np.uint8)  # a title bar
    pixels[:, : width // 6] = rng.integers(200, 230, 3, dtype=np.uint8)  # a side panel
    for row in range(height // 8, height, 24):  # lines of "text"
        line = rng.integers(0, 2, (10, width - width // 5)) * 200
        pixels[row : row + 10, width // 5 :] = 255 - line[..., None].astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def _median_ms(run, repeats: int) -> float:
    return median_seconds(run, replays=repeats, graph=False) * 1e3  # the tower syncs for its layout


def encode_table(model: str, repeats: int) -> list[dict]:
    import torch
    import transformers as tf

    from ninfer.artifact import open_artifact
    from ninfer.media.image import ImageSettings, prepare_image
    from ninfer.media.patches import resized_video_size
    from ninfer.media.video import VideoSettings, sample_frame_indices
    from ninfer.models.vision_loader import load_vision_tower

    artifact = open_artifact(model)
    tower = load_vision_tower(artifact, "cuda", torch.bfloat16)
    peer = tf.Qwen3_5VisionModel(tf.Qwen3_5VisionConfig(**artifact.hf_config["vision_config"]))
    peer = peer.to("cuda", torch.bfloat16).eval()
    peer.load_state_dict({name: param for name, param in tower.state_dict().items()}, strict=True)
    cases = []
    for megapixels in MEGAPIXELS:
        data = screenshot_png(megapixels, seed=megapixels)
        started = time.perf_counter()
        packed = prepare_image(data, ImageSettings())
        prepare_s = time.perf_counter() - started
        patches = packed.patches.reshape(-1)
        cases.append(dict(item=f"image {megapixels} MP", grid=list(packed.grid_thw), prepare_ms=prepare_s * 1e3,
                          png_bytes=len(data), patches=patches))
    settings = VideoSettings()
    geometry = settings.geometry
    frames = len(sample_frame_indices(VIDEO_SECONDS * VIDEO_SOURCE_FPS, VIDEO_SOURCE_FPS, settings))
    height, width = resized_video_size(frames, VIDEO_HEIGHT, VIDEO_WIDTH, geometry.resize_factor,
                                       geometry.temporal_patch_size, settings.min_pixels, settings.max_pixels)
    grid = (-(-frames // geometry.temporal_patch_size), height // geometry.patch_size, width // geometry.patch_size)
    rows = grid[0] * grid[1] * grid[2]
    cases.append(dict(item=f"video {VIDEO_SECONDS} s {VIDEO_WIDTH}x{VIDEO_HEIGHT} ({frames} frames)", grid=list(grid),
                      prepare_ms=None, png_bytes=None,
                      patches=torch.randn(rows * tower.config.patch_dim, dtype=torch.bfloat16)))
    for case in cases:
        patches = case.pop("patches").view(-1, tower.config.patch_dim).cuda()
        grid_list = [case["grid"]]
        grid_tensor = torch.tensor(grid_list, device="cuda")
        with torch.no_grad():
            ours = tower(patches, grid_list)
            theirs = peer(patches, grid_thw=grid_tensor).pooler_output
            case["max_abs_diff_vs_peer"] = (ours.float() - theirs.float()).abs().max().item()
            case["tokens"] = ours.shape[0]
            case["encode_ms"] = _median_ms(lambda: tower(patches, grid_list), repeats)
            case["peer_encode_ms"] = _median_ms(lambda: peer(patches, grid_thw=grid_tensor), repeats)
        case["patch_rows"] = patches.shape[0]
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            before = torch.cuda.memory_allocated()
            tower(patches, grid_list)
        case["encode_peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
        print(f"{case['item']}: grid {case['grid']}, {case['tokens']} tokens, encode {case['encode_ms']:.1f} ms "
              f"(transformers {case['peer_encode_ms']:.1f} ms), peak +{case['encode_peak_mib']:.0f} MiB",
              file=sys.stderr, flush=True)
    return cases


def _stream_chat(client: httpx.Client, url: str, messages: list, max_tokens: int) -> dict:
    model = client.get(url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    started = time.perf_counter()
    ttft = None
    text = []
    usage = {}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise SystemExit(f"HTTP {response.status_code}: {response.text[:400]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                piece = delta.get("content") or delta.get("reasoning_content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - started
                text.append(delta.get("content") or "")
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return dict(ttft_s=ttft, seconds=time.perf_counter() - started, text="".join(text),
                prompt_tokens=usage.get("prompt_tokens"), cached_tokens=details.get("cached_tokens", 0))


def _image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def serve_cases(args: argparse.Namespace) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    out = Path(args.out)
    process = start_server(shlex.split(args.serve_command), args.model, ["--vision", *shlex.split(args.server_args)],
                           args.port, out / "server.log", ready_timeout=args.ready_timeout)
    rng = random.Random(0)
    try:
        with httpx.Client(timeout=args.request_timeout) as client:
            question = [{"type": "text", "text": "What does this screen show?"}]
            _stream_chat(client, url, [{"role": "user", "content": "Warm up."}], 8)
            one_image = []
            for seed in range(args.repeats):
                content = [_image_part(screenshot_png(1, seed=100 + seed)), *question]
                one_image.append(_stream_chat(client, url, [{"role": "user", "content": content}], 8))
            print(f"one 1-MP image: TTFT {statistics.median(r['ttft_s'] for r in one_image) * 1e3:.0f} ms "
                  f"(median of {len(one_image)}), {one_image[0]['prompt_tokens']} prompt tokens",
                  file=sys.stderr, flush=True)
            messages = [{"role": "system", "content": words(rng, args.system_tokens)},
                        {"role": "user", "content": [_image_part(screenshot_png(args.screenshot_mp, seed=7)),
                                                     {"type": "text", "text": "Here is my screen. " + words(rng, 60)}]}]
            turns = []
            for turn in range(args.turns):
                result = _stream_chat(client, url, messages, args.output_tokens)
                previous = turns[-1]["prompt_tokens"] if turns else 0
                result.update(turn=turn + 1, cached_of_previous=(result["cached_tokens"] / previous) if previous else None)
                turns.append(result)
                print(f"turn {turn + 1}: {result['prompt_tokens']} prompt, {result['cached_tokens']} cached, "
                      f"TTFT {result['ttft_s'] * 1e3:.0f} ms", file=sys.stderr, flush=True)
                messages += [{"role": "assistant", "content": result["text"] or "ok"},
                             {"role": "user", "content": words(rng, args.turn_tokens)}]
    finally:
        stop_server(process)
    for record in one_image + turns:
        record.pop("text")
    return {"one_image": one_image, "conversation": turns}


def markdown(result: dict) -> str:
    lines = [f"# Vision benchmark ({result['model']})", "", result["device"], ""]
    if result.get("encode"):
        lines += ["| item | grid (t, h, w) | vision tokens | prepare (CPU) | encode | transformers | peak | max diff vs transformers |",
                  "|---|---|---|---|---|---|---|---|"]
        for case in result["encode"]:
            prepare = f"{case['prepare_ms']:.0f} ms" if case["prepare_ms"] is not None else "—"
            lines.append(f"| {case['item']} | {tuple(case['grid'])} | {case['tokens']:,} | {prepare} | "
                         f"{case['encode_ms']:.1f} ms | {case['peer_encode_ms']:.1f} ms | "
                         f"+{case['encode_peak_mib']:,.0f} MiB | {case['max_abs_diff_vs_peer']:.3g} |")
        lines.append("")
    if result.get("serve"):
        serve = result["serve"]
        ttfts = [r["ttft_s"] for r in serve["one_image"]]
        lines += [f"One 1-MP image + a question, fresh each time: TTFT median {statistics.median(ttfts) * 1e3:.0f} ms "
                  f"over {len(ttfts)} ({serve['one_image'][0]['prompt_tokens']} prompt tokens).", "",
                  "| turn | prompt tokens | cached tokens | cached share of the previous prompt | TTFT |",
                  "|---|---|---|---|---|"]
        for turn in serve["conversation"]:
            share = f"{turn['cached_of_previous']:.1%}" if turn["cached_of_previous"] is not None else "—"
            lines.append(f"| {turn['turn']} | {turn['prompt_tokens']:,} | {turn['cached_tokens']:,} | {share} | "
                         f"{turn['ttft_s'] * 1e3:.0f} ms |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a VLM artifact (HF directory or .ninfer)")
    parser.add_argument("--serve-command", default="ninfer-serve")
    parser.add_argument("--server-args", default="--max-context 32768")
    parser.add_argument("--skip-encode", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--screenshot-mp", type=float, default=1.0)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--turn-tokens", type=int, default=200)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8093)
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--request-timeout", type=float, default=300)
    parser.add_argument("--out", default="vision-results")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    result = {"model": args.model, "device": f"{device} · torch {torch.__version__}"}
    if not args.skip_encode:
        if not torch.cuda.is_available():
            raise SystemExit("the encode table needs a CUDA GPU (--skip-encode to time the server only)")
        result["encode"] = encode_table(args.model, args.repeats)
        torch.cuda.empty_cache()  # the tower and its peer are gone; the server needs the memory
    if not args.skip_serve:
        result["serve"] = serve_cases(args)
    (out / "vision.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "vision.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
