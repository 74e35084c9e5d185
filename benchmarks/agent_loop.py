"""Agent-loop benchmark: long tool-using conversations against ninfer-serve over HTTP.

Each session opens with a long stable prefix (a system prompt plus tool definitions, about
--prefix-tokens), then runs --turns turns: every turn sends the conversation so far plus a new
tool result of --result-tokens MIN,MAX tokens and streams the answer. Several sessions run
interleaved (--sessions, default 2), one turn each in turn, so at --max-concurrency 1 one
session's checkpoints must survive the other's turns. Three wire variants:

  chat       OpenAI Chat Completions; the client resends the whole history every turn
  responses  OpenAI Responses; each turn sends only the new item, chained by previous_response_id
  messages   Anthropic Messages; the whole history, cache_control on the system prompt and tools

The assistant turns are what the server answered (random weights rarely call a tool, so a tool
result then goes back as a user turn; a real call gets a real tool message). Per turn it
reports prompt tokens, cached tokens, the reuse path (from the server's completion record,
when this script started the server), the share of the previous turn's prompt that was
reused, TTFT (first streamed token, client side) and TTFT over the time to prefill only the
new tokens: after the sessions, fresh prompts of that many tokens (nothing to reuse, same
server, same overheads) are timed and interpolated.

  python3 benchmarks/agent_loop.py --serve MODEL_DIR [--server-args "--max-context 131072"]
  python3 benchmarks/agent_loop.py --serve MODEL_DIR --compare-no-reuse   # then again without reuse
  python3 benchmarks/agent_loop.py --url http://127.0.0.1:8080            # a server already running
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_process.py, also when imported by path
from serve_process import start_server, stop_server, wait_for_step_graphs, words  # noqa: E402

DONE_RECORD = re.compile(r"request (\S+) done: .*\(cache (\d+), \d+%, ([a-z ]+)\)")


def make_tools(rng: random.Random, num_tokens: int) -> list[dict]:
    """Function tools whose descriptions make up about num_tokens."""
    names = ["read_file", "write_file", "run_tests", "search_code", "list_dir", "apply_patch", "git_diff", "web_fetch"]
    per_tool = num_tokens // len(names)
    return [
        {
            "name": name,
            "description": words(rng, per_tool),
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "a path in the workspace"},
                               "query": {"type": "string", "description": "what to look for"}},
                "required": ["path"],
            },
        }
        for name in names
    ]


@dataclass
class Turn:
    api: str
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    request_id: str | None
    ttft_s: float
    total_s: float
    output_tokens: int
    path: str | None = None  # from the server's completion record (when this script started it)
    reuse_of_previous: float | None = None  # cached / the previous turn's prompt tokens
    new_token_prefill_s: float | None = None  # TTFT of a fresh prompt as long as the new tokens
    ttft_over_new_prefill: float | None = None


@dataclass
class Session:
    api: str
    index: int
    system: str
    tools: list[dict]
    rng: random.Random
    history: list[dict] = field(default_factory=list)
    previous_response_id: str | None = None
    turns: list[Turn] = field(default_factory=list)


def sse(response: httpx.Response):
    """(event name or None, parsed data) of each SSE frame."""
    event = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[len("event: "):]
        elif line.startswith("data: "):
            data = line[len("data: "):]
            if data != "[DONE]":
                yield event, json.loads(data)
            event = None


class Client:
    def __init__(self, url: str, model: str, max_tokens: int, timeout: float):
        self.http = httpx.Client(base_url=url, timeout=timeout, headers={"authorization": "Bearer unused"})
        self.model = model
        self.max_tokens = max_tokens

    def turn(self, s: Session, result_text: str) -> Turn:
        started = time.perf_counter()
        if s.api == "chat":
            request_id, first, usage, reply = self._chat(s, result_text)
            prompt, cached, out = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]
        elif s.api == "responses":
            request_id, first, usage, reply = self._responses(s, result_text)
            prompt, cached, out = usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"], usage["output_tokens"]
        else:
            request_id, first, usage, reply = self._messages(s, result_text)
            cached = usage.get("cache_read_input_tokens") or 0
            prompt, out = usage["input_tokens"] + cached, usage["output_tokens"]
        done = time.perf_counter()
        ttft = (first or done) - started
        turn = Turn(s.api, s.index, len(s.turns) + 1, prompt, cached, request_id, ttft, done - started, out)
        s.turns.append(turn)
        return turn

    def _post(self, path: str, body: dict):
        return self.http.stream("POST", path, json=body)

    def _chat(self, s: Session, result_text: str):
        if s.history and s.history[-1].get("tool_calls"):
            s.history += [{"role": "tool", "tool_call_id": c["id"], "content": result_text} for c in s.history[-1]["tool_calls"]]
        else:
            s.history.append({"role": "user", "content": result_text})
        body = {
            "model": self.model, "messages": [{"role": "system", "content": s.system}, *s.history],
            "tools": [{"type": "function", "function": t} for t in s.tools], "max_tokens": self.max_tokens,
            "stream": True, "stream_options": {"include_usage": True},
        }
        first, usage, content, reasoning, calls = None, None, [], [], {}
        with self._post("/v1/chat/completions", body) as response:
            response.raise_for_status()
            request_id = response.headers.get("x-request-id")
            for _, chunk in sse(response):
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    if first is None and (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")):
                        first = time.perf_counter()
                    content.append(delta.get("content") or "")
                    reasoning.append(delta.get("reasoning_content") or "")
                    for call in delta.get("tool_calls") or []:
                        slot = calls.setdefault(call["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                        slot["id"] = call.get("id") or slot["id"]
                        function = call.get("function") or {}
                        slot["function"]["name"] += function.get("name") or ""
                        slot["function"]["arguments"] += function.get("arguments") or ""
        message = {"role": "assistant", "content": "".join(content)}
        if "".join(reasoning):
            message["reasoning_content"] = "".join(reasoning)
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        s.history.append(message)
        return request_id, first, usage, message

    def _responses(self, s: Session, result_text: str):
        body = {
            "model": self.model, "input": [{"role": "user", "content": result_text}], "max_output_tokens": self.max_tokens,
            "tools": [{"type": "function", **t} for t in s.tools], "stream": True,
        }
        # Instructions do not carry over a previous_response_id chain: clients resend them each turn.
        body["instructions"] = s.system
        if s.previous_response_id is not None:
            body["previous_response_id"] = s.previous_response_id
        first, usage = None, None
        with self._post("/v1/responses", body) as response:
            response.raise_for_status()
            request_id = response.headers.get("x-request-id")
            for _, event in sse(response):
                kind = event.get("type", "")
                if first is None and kind.endswith(".delta"):
                    first = time.perf_counter()
                if kind == "response.failed":
                    raise RuntimeError(f"response failed: {event['response'].get('error')}")
                if kind in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens
                    usage = event["response"]["usage"]
                    s.previous_response_id = event["response"]["id"]
        return request_id, first, usage, None

    def _messages(self, s: Session, result_text: str):
        s.history.append({"role": "user", "content": [{"type": "text", "text": result_text}]})
        tools = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in s.tools]
        tools[-1]["cache_control"] = {"type": "ephemeral"}
        body = {
            "model": self.model, "max_tokens": self.max_tokens, "stream": True, "tools": tools,
            "system": [{"type": "text", "text": s.system, "cache_control": {"type": "ephemeral"}}],
            "messages": s.history,
        }
        first, usage, blocks = None, {}, []
        with self._post("/v1/messages", body) as response:
            response.raise_for_status()
            request_id = response.headers.get("request-id")
            for name, event in sse(response):
                if name == "message_start":
                    usage.update({k: v for k, v in event["message"]["usage"].items() if v is not None})
                elif name == "content_block_start":
                    blocks.append(dict(event["content_block"]))
                elif name == "content_block_delta":
                    if first is None:
                        first = time.perf_counter()
                    delta, block = event["delta"], blocks[event["index"]]
                    for key in ("text", "thinking", "partial_json", "signature"):
                        if key in delta:
                            block[key if key != "partial_json" else "input_json"] = block.get(
                                key if key != "partial_json" else "input_json", "") + delta[key]
                elif name == "message_delta":
                    usage.update({k: v for k, v in (event.get("usage") or {}).items() if v is not None})
        content = []
        for block in blocks:
            if block["type"] == "tool_use":
                block["input"] = json.loads(block.pop("input_json", "") or "{}")
            block.pop("input_json", None)
            content.append(block)
        s.history.append({"role": "assistant", "content": content or [{"type": "text", "text": ""}]})
        return request_id, first, usage, None


def paths_from_log(log_path: Path) -> dict[str, tuple[int, str]]:
    found = {}
    for line in log_path.read_text(errors="replace").splitlines():
        match = DONE_RECORD.search(line)
        if match:
            found[match.group(1)] = (int(match.group(2)), match.group(3).replace(" ", "_"))
    return found


def run_variant(client: Client, api: str, args, label: str) -> list[Turn]:
    sessions = []
    for index in range(args.sessions):
        rng = random.Random(f"{args.seed}:{api}:{index}")
        tools = make_tools(rng, args.prefix_tokens // 3)
        system = f"Session {index}. " + words(rng, args.prefix_tokens - args.prefix_tokens // 3)
        sessions.append(Session(api, index, system, tools, rng))
    low, high = args.result_tokens
    turns = []
    for number in range(1, args.turns + 1):
        for s in sessions:
            result = f"Tool result {number}:\n" + words(s.rng, s.rng.randint(low, high))
            turn = client.turn(s, result)
            turns.append(turn)
            with open(Path(args.out) / "turns.jsonl", "a") as raw:  # survives an interrupted run
                raw.write(json.dumps({"run": label, **asdict(turn)}) + "\n")
            print(f"  {api:9s} session {s.index} turn {number:2d}: prompt {turn.prompt_tokens:6d} "
                  f"cached {turn.cached_tokens:6d} ttft {turn.ttft_s:6.3f}s", file=sys.stderr, flush=True)
    return turns


def calibrate(client: Client, turns: list[Turn], repeats: int = 3) -> list[tuple[int, float]]:
    """(prompt tokens, median TTFT) of fresh prompts spanning the turns' new-token counts."""
    new = sorted(t.prompt_tokens - t.cached_tokens for t in turns if t.turn > 1)
    if not new:
        return []
    targets = sorted({new[0], new[len(new) // 2], new[-1]})
    points = []
    for target in targets:
        ttfts, prompt = [], target
        for repeat in range(repeats):
            rng = random.Random(f"calibrate:{target}:{repeat}")
            nonce = f"{rng.getrandbits(64):x} "  # a new first token: nothing to reuse
            s = Session("chat", -1, "", [], rng)
            # Sized to the target as the server counts it (chat framing included), within a few tokens.
            t = client.turn(s, nonce + words(rng, max(1, target - 12)))
            ttfts.append(t.ttft_s)
            prompt = t.prompt_tokens
        points.append((prompt, statistics.median(ttfts)))
    return sorted(points)


def interpolate(points: list[tuple[int, float]], x: int) -> float | None:
    if not points:
        return None
    if x <= points[0][0] or len(points) == 1:
        return points[0][1] if x <= points[0][0] else points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1)
    return points[-1][1] * x / points[-1][0]  # past the last point: proportional


def annotate(turns: list[Turn], log_path: Path | None, prefill_points: list[tuple[int, float]]) -> None:
    """Reuse path (from the server's log), reuse of the previous prompt, TTFT against new-token prefill."""
    records = paths_from_log(log_path) if log_path else {}
    by_session: dict[tuple[str, int], list[Turn]] = {}
    for t in turns:
        by_session.setdefault((t.api, t.session), []).append(t)
    for session_turns in by_session.values():
        for previous, t in zip([None, *session_turns], session_turns):
            t.path = records[t.request_id][1] if t.request_id in records else None
            if previous is not None:
                t.reuse_of_previous = t.cached_tokens / previous.prompt_tokens
                t.new_token_prefill_s = interpolate(prefill_points, t.prompt_tokens - t.cached_tokens)
                if t.new_token_prefill_s:
                    t.ttft_over_new_prefill = t.ttft_s / t.new_token_prefill_s


def table(turns: list[Turn]) -> str:
    lines = ["| api | session | turn | prompt | cached | path | reuse of previous | TTFT s | TTFT / new-token prefill |",
             "|---|---|---|---|---|---|---|---|---|"]
    for t in turns:
        reuse = f"{100 * t.reuse_of_previous:.1f}%" if t.reuse_of_previous is not None else ""
        ratio = f"{t.ttft_over_new_prefill:.2f}" if t.ttft_over_new_prefill is not None else ""
        lines.append(f"| {t.api} | {t.session} | {t.turn} | {t.prompt_tokens} | {t.cached_tokens} | {t.path or ''} "
                     f"| {reuse} | {t.ttft_s:.3f} | {ratio} |")
    return "\n".join(lines)


def summary(turns: list[Turn]) -> dict:
    later = [t for t in turns if t.reuse_of_previous is not None]
    ratios = [t.ttft_over_new_prefill for t in later if t.ttft_over_new_prefill is not None]
    return {
        "turns": len(turns),
        "min_reuse_of_previous": min((t.reuse_of_previous for t in later), default=None),
        "median_reuse_of_previous": statistics.median([t.reuse_of_previous for t in later]) if later else None,
        "median_ttft_s_after_first": statistics.median([t.ttft_s for t in later]) if later else None,
        "median_ttft_over_new_prefill": statistics.median(ratios) if ratios else None,
        "last_prompt_tokens": max((t.prompt_tokens for t in turns), default=0),
        "last_ttft_s": turns[-1].ttft_s if turns else None,
    }


def run_all(args, server_args: list[str], label: str, apis: list[str]) -> dict:
    process = log_path = None
    url = args.url
    if args.serve:
        log_path = Path(args.out) / f"server-{label}.log"
        port = args.port
        process = start_server(shlex.split(args.serve_command), args.serve, server_args, port, log_path,
                               args.ready_timeout)
        url = f"http://127.0.0.1:{port}"
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        client = Client(url, model, args.max_tokens, args.request_timeout)
        if args.warmup:
            client.turn(Session("chat", -1, "warm-up", [], random.Random(0)), "Say hi.")
        if log_path is not None:
            wait_for_step_graphs(log_path)  # no session turn waits behind a capture
        results = {}
        for api in apis:
            print(f"[{label}] {api}: {args.sessions} sessions x {args.turns} turns", file=sys.stderr, flush=True)
            turns = run_variant(client, api, args, label)
            results[api] = turns
        # Last, so these fresh prompts cannot push the sessions' checkpoints out.
        points = calibrate(client, [t for turns in results.values() for t in turns]) if args.calibrate else []
    finally:
        if process is not None:
            stop_server(process)
    report = {"new_token_prefill_points": points}
    for api, turns in results.items():
        annotate(turns, log_path, points)
        report[api] = {"summary": summary(turns), "turns": [asdict(t) for t in turns]}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--serve", metavar="MODEL", help="start ninfer-serve on this model directory (paths read from its log)")
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8080")
    parser.add_argument("--server-args", default="", help="extra ninfer-serve flags, one string")
    parser.add_argument("--serve-command", default="ninfer-serve",
                        help="how to start the server (default ninfer-serve; e.g. 'python3 -m ninfer.cli serve')")
    parser.add_argument("--compare-no-reuse", action="store_true", help="then run again with --no-prefix-reuse (needs --serve)")
    parser.add_argument("--apis", default="chat,responses,messages", help="comma list of chat, responses, messages")
    parser.add_argument("--sessions", type=int, default=2, help="interleaved sessions (default 2)")
    parser.add_argument("--turns", type=int, default=20, help="turns per session (default 20)")
    parser.add_argument("--no-reuse-turns", type=int, help="turns per session in the --no-prefix-reuse run (default: --turns)")
    parser.add_argument("--no-reuse-apis", help="variants in the --no-prefix-reuse run (default: --apis)")
    parser.add_argument("--prefix-tokens", type=int, default=30000, help="system prompt + tools, about (default 30000)")
    parser.add_argument("--result-tokens", default="1000,4000", help="tool result size range MIN,MAX (default 1000,4000)")
    parser.add_argument("--max-tokens", type=int, default=32, help="answer length per turn (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8199, help="port for --serve (default 8199)")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True, help="one short request first (default on)")
    parser.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                        help="time fresh prompts as long as the turns' new tokens (default on)")
    parser.add_argument("--ready-timeout", type=float, default=1800.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="folder for agent_loop.json, agent_loop.md and server logs")
    args = parser.parse_args(argv)
    args.apis = [a for a in args.apis.split(",") if a]
    args.no_reuse_apis = [a for a in (args.no_reuse_apis or "").split(",") if a]
    bad = [a for a in [*args.apis, *args.no_reuse_apis] if a not in ("chat", "responses", "messages")]
    if bad:
        parser.error(f"--apis: unknown {', '.join(bad)}")
    low, high = (int(x) for x in args.result_tokens.split(","))
    args.result_tokens = (low, high)
    if args.compare_no_reuse and not args.serve:
        parser.error("--compare-no-reuse needs --serve (it restarts the server with --no-prefix-reuse)")
    args.out = args.out or tempfile.mkdtemp(prefix="agent-loop-")
    os.makedirs(args.out, exist_ok=True)
    server_args = shlex.split(args.server_args)
    report = {"options": dict(vars(args)), "reuse": run_all(args, server_args, "reuse", args.apis)}
    if args.compare_no_reuse:
        turns = args.turns
        args.turns = args.no_reuse_turns or turns
        apis = args.no_reuse_apis or args.apis
        report["no_reuse"] = run_all(args, [*server_args, "--no-prefix-reuse"], "no-reuse", apis)
        args.turns = turns
    out = Path(args.out)
    (out / "agent_loop.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = []
    for mode in ("reuse", "no_reuse"):
        for api, result in report.get(mode, {}).items():
            if api == "new_token_prefill_points":
                continue
            markdown += [f"## {api}, {mode.replace('_', ' ')}", "", "```", json.dumps(result["summary"], indent=2), "```", "",
                         table([Turn(**t) for t in result["turns"]]), ""]
    (out / "agent_loop.md").write_text("\n".join(markdown))
    print("\n".join(markdown))
    print(f"written: {out / 'agent_loop.json'}, {out / 'agent_loop.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
