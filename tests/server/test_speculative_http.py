"""Speculative decoding (--spec mtp) through the HTTP endpoints, driven by the official SDKs.

Real servers on loopback sockets, all on one tiny random Qwen3.5 artifact with an MTP head:
`plain` (no --spec), `mtp` (--spec mtp --draft-tokens 3: the random MTP head, whose drafts
are almost always rejected), `lmhead` (the same with --lm-head-draft: the reduced proposal
head, meaningful here since the vocabulary has 248K ids) and `oracle` (--spec mtp
--draft-tokens 3 whose drafter proposes the plain server's own greedy continuation of the
prompt, so every draft is accepted and rounds commit four tokens: stops and limits then fall
inside rounds). Every server computes in float32: the CPU default stores Linear weights in
float16 and sends one- and two-row products through a float16 GEMV but larger ones (a
verification row of four tokens) through a float32 GEMM, whose rounding differs.

Checked against the plain server: greedy text, finish and usage for Chat, Responses and
Messages, aggregate and streamed; output limits and stop strings that end inside a round;
the follow-up turn's reuse; llama.cpp timings' draft keys; request_done's speculative
counters against docs/request-log.schema.json and /metrics; seeded sampling; start-up errors.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ninfer.cli import serve_main
from tests.net import ROOT, free_port
from tests.server.conftest import RunningServer, serve_config, start_server, wait_until
from tests.server.speculative_servers import ContinuationBook, Result, chat, openai_client, oracle_core

SCHEMA = json.loads((ROOT / "docs" / "request-log.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
DRAFTS = 3
NO_THINKING = {
    "chat": {"extra_body": {"enable_thinking": False}},
    "responses": {"reasoning": {"effort": "none"}},
    "messages": {"thinking": {"type": "disabled"}},
}


# ---- the servers ------------------------------------------------------------------------------------


class Collect:
    """The request events as the log file holds them (synchronously, unlike the file's writer)."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def record(self, event: dict) -> None:
        self.events.append(json.loads(json.dumps(event)))

    def close(self) -> None:
        pass

    def done(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "request_done"]


@dataclasses.dataclass
class Servers:
    running: dict[str, RunningServer]
    logs: dict[str, Path]
    events: dict[str, Collect]
    book: ContinuationBook

    def __getitem__(self, name: str) -> RunningServer:
        return self.running[name]


@pytest.fixture(scope="module")
def servers(mtp_artifact, tmp_path_factory) -> Iterator[Servers]:
    log_dir = tmp_path_factory.mktemp("spec-logs")
    book = ContinuationBook()
    options = {
        "plain": {},
        "mtp": {"spec": "mtp", "draft_tokens": DRAFTS},
        "lmhead": {"spec": "mtp", "draft_tokens": DRAFTS, "lm_head_draft": True},
        "oracle": {"spec": "mtp", "draft_tokens": DRAFTS},
    }
    running: dict[str, RunningServer] = {}
    logs = {name: log_dir / f"{name}.jsonl" for name in options}
    events = {name: Collect() for name in options}
    try:
        for name, extra in options.items():
            config = serve_config(mtp_artifact, max_concurrency=2, default_max_tokens=16, device_state_slots=6,
                                  dtype="float32", request_log_jsonl=str(logs[name]), **extra)
            build = oracle_core(mtp_artifact, config, book, DRAFTS) if name == "oracle" else None
            running[name] = start_server(config, build)
            running[name].serving.events.observers.append(events[name])
        book.watch_plain(running["plain"].core)
        yield Servers(running, logs, events, book)
    finally:
        for server in running.values():
            server.stop()


def anthropic_client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


# ---- one exchange per protocol, reduced to what must agree --------------------------------------


def responses(server: RunningServer, prompt: str, stream: bool = False, **kwargs) -> Result:
    client = openai_client(server)
    request = dict(model=server.serving.model_id, input=prompt, **kwargs)
    if not stream:
        resp = client.responses.create(**request)
    else:
        events = list(client.responses.create(**request, stream=True))
        terminal = [e for e in events if e.type in ("response.completed", "response.incomplete", "response.failed")]
        assert len(terminal) == 1 and events[-1] is terminal[0]
        resp = terminal[0].response
        streamed_text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        streamed_reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(part.text for item in resp.output if item.type == "message" for part in item.content)
    reasoning = "".join(part.text for item in resp.output if item.type == "reasoning" for part in item.content or ())
    if stream:
        assert (streamed_text, streamed_reasoning) == (text, reasoning)
    usage = resp.usage
    incomplete = resp.incomplete_details.reason if resp.incomplete_details is not None else None
    return Result(text, reasoning, (resp.status, incomplete),
                  (usage.input_tokens, usage.output_tokens, usage.input_tokens_details.cached_tokens))


def messages(server: RunningServer, prompt: str, stream: bool = False, **kwargs) -> Result:
    client = anthropic_client(server)
    # This SDK has no sampling arguments: the server reads them from the body.
    sampling = {key: kwargs.pop(key) for key in ("temperature", "top_k") if key in kwargs}
    if sampling:
        kwargs["extra_body"] = {**kwargs.get("extra_body", {}), **sampling}
    request = dict(model="any", max_tokens=kwargs.pop("max_tokens", 16),
                   messages=kwargs.pop("messages", None) or [{"role": "user", "content": prompt}], **kwargs)
    if not stream:
        message = client.messages.create(**request)
    else:
        with client.messages.stream(**request) as events:
            deltas = [e.delta for e in events if e.type == "content_block_delta"]
            message = events.get_final_message()
        streamed_text = "".join(d.text for d in deltas if d.type == "text_delta")
        streamed_thinking = "".join(d.thinking for d in deltas if d.type == "thinking_delta")
    text = "".join(block.text for block in message.content if block.type == "text")
    thinking = "".join(block.thinking for block in message.content if block.type == "thinking")
    if stream:
        assert (streamed_text, streamed_thinking) == (text, thinking)
    usage = message.usage
    cached = usage.cache_read_input_tokens or 0
    return Result(text, thinking, (message.stop_reason, message.stop_sequence),
                  (usage.input_tokens + cached, usage.output_tokens, cached))


EXCHANGES = {"chat": chat, "responses": responses, "messages": messages}
LIMIT_FIELD = {"chat": "max_tokens", "responses": "max_output_tokens", "messages": "max_tokens"}


def check_timings(result: Result, drafted: bool) -> None:
    timings = result.timings
    prompt_tokens, completion_tokens, cached = result.usage
    assert timings["cache_n"] == cached and timings["cache_n"] + timings["prompt_n"] == prompt_tokens
    assert timings["predicted_n"] == completion_tokens
    if not drafted:
        assert "draft_n" not in timings and "draft_n_accepted" not in timings
        return
    draft_n, accepted = timings["draft_n"], timings["draft_n_accepted"]
    assert type(draft_n) is int and type(accepted) is int
    assert 0 < draft_n and 0 <= accepted <= draft_n


# ---- 1. greedy output, usage and timings equal the plain server's -------------------------------


CASES = [(name, protocol) for name in ("mtp", "oracle") for protocol in EXCHANGES] + [("lmhead", "chat")]


@pytest.mark.parametrize("name, protocol", CASES)
def test_greedy_output_and_usage_equal_plain_decoding(servers, name, protocol):
    """The same prompt twice (aggregate, then streamed) on each server: the streamed turn reuses
    the first one's prompt on both, so usage's cached tokens are compared too."""
    exchange = EXCHANGES[protocol]
    prompt = f"Greedy case {name} {protocol}: tell me about rivers."
    results = {}
    for server_name in ("plain", name):
        server = servers[server_name]
        aggregate = exchange(server, prompt, temperature=0)
        streamed = exchange(server, prompt, stream=True, temperature=0)
        assert streamed.key()[:3] == aggregate.key()[:3]
        assert streamed.usage[:2] == aggregate.usage[:2]
        results[server_name] = (aggregate, streamed)
    assert results["plain"][1].usage[2] > 0  # the repeat reused the first exchange's prompt
    for plain, spec in zip(results["plain"], results[name]):
        assert spec.key() == plain.key()
        assert spec.text + spec.reasoning  # the tiny model's output is never empty at 16 tokens
    head = servers[name].core.runner.speculator.drafter.head if name != "oracle" else None
    if head is not None:
        # --lm-head-draft drafts over a reduced vocabulary; without it over the whole one.
        assert (head.vocab_size < head.num_valid_tokens) == (name == "lmhead")
    if protocol == "chat":
        for plain, spec in zip(results["plain"], results[name]):
            check_timings(plain, drafted=False)
            check_timings(spec, drafted=True)
        if name == "oracle":
            for spec in results[name]:
                assert spec.timings["draft_n_accepted"] == spec.timings["draft_n"]


# ---- 2. output limits, stop strings and options --------------------------------------------------


# With every draft accepted a round commits 4 tokens: output tokens 3-6, 7-10, 11-14 each come
# from one round (token 1 from the prompt step, token 2 from the first decode step), so these
# limits end a round at each of its positions.
@pytest.mark.parametrize("protocol, limit", [("chat", 7), ("chat", 8), ("responses", 9), ("messages", 10),
                                             ("chat", 12)])
def test_an_output_limit_inside_a_round_is_exact(servers, protocol, limit):
    exchange = EXCHANGES[protocol]
    prompt = f"Limit case {protocol} {limit}: count the stars."
    kwargs = {LIMIT_FIELD[protocol]: limit, "temperature": 0, **NO_THINKING[protocol]}
    plain = exchange(servers["plain"], prompt, **kwargs)
    oracle = exchange(servers["oracle"], prompt, **kwargs)
    done = servers.events["oracle"].done()[-1]
    assert oracle.key() == plain.key()
    assert oracle.usage[1] == limit
    assert oracle.finish == {"chat": ("length",), "responses": ("incomplete", "max_output_tokens"),
                             "messages": ("max_tokens", None)}[protocol]
    counters = done["speculative"]
    assert done["completion_tokens"] == limit and counters["accepted_tokens"] > 0
    # Every draft verified was the plain continuation, so each was accepted; nothing past the limit.
    assert counters["accepted_tokens"] == counters["drafted_tokens"]
    assert 1 + counters["rounds"] + counters["fallback_steps"] + counters["accepted_tokens"] == limit


def _stop_string(servers: Servers, content: str, index: int, inside: bool) -> tuple[str, str]:
    """A stop string for the plain server's last greedy output (whose text is `content`) that
    first completes with output token `index` (0-based): its whole text, or (inside) just the
    token's first character. Returns it and the text a stop there leaves."""
    tokenizer = servers["plain"].serving.artifact.tokenizer
    tokens = servers.book.last_plain
    before, upto = tokenizer.decode(tokens[:index]), tokenizer.decode(tokens[: index + 1])
    assert content.startswith(upto) and upto.startswith(before) and "\ufffd" not in upto
    piece = upto[len(before):]
    stop = piece[:1] if inside else piece
    assert stop.strip() and (len(piece) > 1 or not inside), f"token {index} is {piece!r}"
    end = len(before) + len(stop)
    for start in range(len(before), -1, -1):  # widen leftwards until the first occurrence ends there
        candidate = content[start:end]
        if content.find(candidate) + len(candidate) == end:
            return candidate, content[:start]
    raise AssertionError("unreachable: the whole prefix is its own first occurrence")


# 0-based output tokens 6..9 are one round's three drafts and the token after them.
@pytest.mark.parametrize("protocol, index, inside", [("chat", 6, False), ("chat", 7, False), ("chat", 8, True),
                                                     ("chat", 9, False), ("messages", 7, True)])
def test_a_stop_string_inside_a_round_trims_as_plain_decoding(servers, protocol, index, inside):
    exchange = EXCHANGES[protocol]
    prompt = f"Stop case {protocol} {index} {inside}: name the colours."
    kwargs = {LIMIT_FIELD[protocol]: 16, "temperature": 0, **NO_THINKING[protocol]}
    full = exchange(servers["plain"], prompt, **kwargs)
    stop, kept = _stop_string(servers, full.text, index, inside)
    field = {"chat": "stop", "messages": "stop_sequences"}[protocol]
    kwargs[field] = [stop]
    plain = exchange(servers["plain"], prompt, **kwargs)
    assert plain.text == kept and plain.usage[1] == index + 1
    for name in ("oracle", "mtp"):
        exchange(servers[name], prompt, **{k: v for k, v in kwargs.items() if k != field})  # the same history
        spec = exchange(servers[name], prompt, **kwargs)
        assert spec.key() == plain.key()
        assert spec.finish == {"chat": ("stop",), "messages": ("stop_sequence", stop)}[protocol]
        if name == "oracle":
            counters = servers.events[name].done()[-1]["speculative"]
            assert counters["accepted_tokens"] > 0
            streamed = exchange(servers[name], prompt, stream=True, **kwargs)
            assert streamed.key()[:3] == plain.key()[:3] and streamed.usage[:2] == plain.usage[:2]


def test_the_speculative_server_refuses_and_accepts_what_the_plain_server_does(servers):
    prompt = "Options case: describe a lake."
    for refused, param in (({"logit_bias": {"5": 10}}, "logit_bias"), ({"n": 2}, "n")):
        bodies = []
        for name in ("plain", "mtp"):
            with pytest.raises(openai.BadRequestError) as err:
                chat(servers[name], prompt, **refused)
            bodies.append({k: v for k, v in err.value.body.items() if k != "request_id"})
        assert bodies[0] == bodies[1] and bodies[0]["param"] == param
    # Penalties and sampler limits are served with speculation; greedy output is unchanged.
    options = dict(temperature=0, presence_penalty=1.5, frequency_penalty=0.5, max_tokens=12,
                   extra_body={"top_k": 5, "min_p": 0.05, "enable_thinking": False})
    plain = chat(servers["plain"], prompt, **options)
    for name in ("oracle", "mtp"):
        assert chat(servers[name], prompt, **options).key() == plain.key()


def test_constrained_output_and_log_probabilities_equal_plain_decoding(servers):
    """A JSON answer (greedy, with log probabilities) and a forced tool call decode without drafts
    under --spec: the same tokens, text and values as the plain server."""
    tool = {"type": "function", "function": {"name": "note", "strict": True, "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}}
    cases = [
        dict(response_format={"type": "json_object"}, logprobs=True, top_logprobs=2),
        dict(tools=[tool], tool_choice="required"),
    ]
    for i, extra in enumerate(cases):
        prompt = f"Constraint case {i}: write it down."
        kwargs = dict(max_tokens=12, temperature=0, extra_body={"enable_thinking": False}, **extra)
        plain = openai_client(servers["plain"]).chat.completions.create(
            model=servers["plain"].serving.model_id, messages=[{"role": "user", "content": prompt}], **kwargs)
        for name in ("mtp",):
            spec = openai_client(servers[name]).chat.completions.create(
                model=servers[name].serving.model_id, messages=[{"role": "user", "content": prompt}], **kwargs)
            assert spec.choices[0].message == plain.choices[0].message
            assert spec.usage.completion_tokens == plain.usage.completion_tokens
            if extra.get("logprobs"):
                spec_values = [e.logprob for e in spec.choices[0].logprobs.content]
                assert spec_values == pytest.approx([e.logprob for e in plain.choices[0].logprobs.content], abs=1e-4)
            assert servers.events[name].done()[-1]["speculative"]["rounds"] == 0


def test_no_draft_work_no_draft_keys(servers):
    """max_tokens 0 computes the prompt only; the first token comes from the prompt step, the
    second from the first decode step (no drafts yet), and a step with one token left before
    the limit has no room for a draft: no round ran, so the timings have no draft keys and the
    log's counters are the backend's with no rounds. At 4 tokens, one round verifies one draft."""
    fallback_steps = {0: 0, 1: 0, 2: 1, 3: 2, 4: 1}
    for limit, fallback in fallback_steps.items():
        prompt = f"No drafts case {limit}."
        chat(servers["plain"], prompt, max_tokens=limit, temperature=0)  # the oracle's continuation
        result = chat(servers["oracle"], prompt, max_tokens=limit, temperature=0)
        assert result.usage[1] == limit and result.finish == ("length",)
        check_timings(result, drafted=limit == 4)
        counters = servers.events["oracle"].done()[-1]["speculative"]
        assert counters["backend"] == "mtp" and counters["draft_window"] == DRAFTS
        assert (counters["rounds"], counters["fallback_steps"]) == (int(limit == 4), fallback)
        assert counters["drafted_tokens"] == counters["accepted_tokens"] == int(limit == 4)


# ---- 3. timings: draft keys on the terminal timings only ---------------------------------------


@pytest.mark.parametrize("include_usage", [False, True])
def test_running_timings_have_no_draft_keys_and_the_terminal_ones_do(servers, include_usage):
    """timings_per_token attaches running snapshots to visible chunks; draft_n and
    draft_n_accepted are terminal, on the last JSON chunk only (the usage chunk, else the
    finish chunk), even when the last visible text comes with the request's final tokens."""
    body = {"messages": [{"role": "user", "content": f"Timings case {include_usage}: a short poem."}],
            "max_tokens": 14, "temperature": 0, "stream": True, "timings_per_token": True,
            "stream_options": {"include_usage": include_usage}}
    frames = {}
    for name in ("plain", "oracle"):
        with httpx.stream("POST", servers[name].base_url + "/v1/chat/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            data = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        frames[name] = [json.loads(frame) for frame in data[:-1]]
    for name, chunks in frames.items():
        last = chunks[-1]
        assert ("usage" in last and last["choices"] == []) if include_usage else last["choices"][0]["finish_reason"]
        visible = [c for c in chunks[:-1] if c["choices"] and (c["choices"][0]["delta"].get("content")
                                                              or c["choices"][0]["delta"].get("reasoning_content"))]
        assert visible and all("timings" in c for c in visible)
        for chunk in chunks[:-1]:
            assert not {"draft_n", "draft_n_accepted"} & set(chunk.get("timings", {})), (name, chunk)
        terminal = last["timings"]
        if name == "oracle":
            assert terminal["draft_n"] == terminal["draft_n_accepted"] > 0
            # The running snapshots count committed tokens up to the terminal count.
            counts = [c["timings"]["predicted_n"] for c in visible]
            assert counts == sorted(counts) and counts[-1] <= terminal["predicted_n"] == 14
        else:
            assert "draft_n" not in terminal


# ---- 4. the turn after a reply that ended inside a round ----------------------------------------


# With thinking off and preserve_thinking, the next prompt renders the reply's turn as it was
# generated, so the reply's endpoint checkpoint is what the next turn reuses; a stop's last token
# never comes back (the text is cut before it). Output token 5 (0-based) is the target's token
# after a round's drafts, 7 and 8 are accepted drafts on the oracle.
@pytest.mark.parametrize("protocol, index", [("chat", 5), ("chat", 7), ("chat", 8), ("messages", 7)])
def test_the_next_turn_reuses_a_reply_that_stopped_inside_a_round(servers, protocol, index):
    exchange = EXCHANGES[protocol]
    question = f"Follow-up case {protocol} {index}: which way is north?"
    no_thinking = {"chat": {"extra_body": {"enable_thinking": False, "preserve_thinking": True}},
                   "messages": {"thinking": {"type": "disabled"}, "extra_body": {"preserve_thinking": True}}}[protocol]
    kwargs = {LIMIT_FIELD[protocol]: 16, "temperature": 0, **no_thinking}
    field = {"chat": "stop", "messages": "stop_sequences"}[protocol]
    turns = {}
    for name in ("plain", "oracle", "mtp"):
        server = servers[name]
        full = exchange(server, question, **kwargs)
        if name == "plain":
            stop, _ = _stop_string(servers, full.text, index, inside=False)
        first = exchange(server, question, **kwargs, **{field: [stop]})
        if name == "oracle":
            assert servers.events[name].done()[-1]["speculative"]["accepted_tokens"] > 0
        history = [{"role": "user", "content": question}, {"role": "assistant", "content": first.text},
                   {"role": "user", "content": "And south?"}]
        second = exchange(server, "", messages=history, **kwargs)
        turns[name] = (first, second, servers.events[name].done()[-1])
    first, second, done = turns["plain"]
    # The reply was reused (not only the first prompt): its endpoint, up to the stop's last token.
    assert done["prefix_reuse_path"] == "private_endpoint" and second.usage[2] == first.usage[0] + index
    for name in ("oracle", "mtp"):
        spec_first, spec_second, spec_done = turns[name]
        assert (spec_first.key(), spec_second.key()) == (first.key(), second.key())
        assert spec_done["prefix_reuse_path"] == done["prefix_reuse_path"]


# ---- 5. seeded sampling repeats ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mtp", "oracle"])
def test_a_seeded_sampled_request_repeats_exactly(servers, name):
    prompt = f"Seed case {name}: invent a word."
    options = dict(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, extra_body={"top_k": 20})
    chat(servers["plain"], prompt, temperature=0, max_tokens=12)  # the oracle drafts the greedy continuation
    first = chat(servers[name], prompt, **options)
    again = chat(servers[name], prompt, **options)
    streamed = chat(servers[name], prompt, stream=True, **options)
    assert first.text + first.reasoning and first.usage[1] == 12
    assert again.key()[:3] == first.key()[:3] == streamed.key()[:3]
    other = chat(servers[name], prompt, **{**options, "seed": 99})
    assert other.text + other.reasoning != first.text + first.reasoning  # the seed matters


# ---- 6. request log and /metrics -----------------------------------------------------------------


def metric_values(server: RunningServer) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("ninfer:spec_decode_") and sample.name.endswith("_total")}


SPEC_METRICS = {"ninfer:spec_decode_num_drafts_total": "rounds",
                "ninfer:spec_decode_num_draft_tokens_total": "drafted_tokens",
                "ninfer:spec_decode_num_accepted_tokens_total": "accepted_tokens"}


@pytest.mark.parametrize("name", ["plain", "mtp", "oracle"])
def test_metrics_move_by_the_request_logs_speculative_counters(servers, name):
    server = servers[name]
    before = metric_values(server)
    assert set(before) == set(SPEC_METRICS)  # present without --spec too, at zero
    first = len(servers.events[name].done())
    prompt = f"Metrics case {name}: tell a story."
    chat(servers["plain"], prompt, temperature=0)  # the oracle's continuation
    if name != "plain":
        chat(server, prompt, temperature=0)
    chat(server, prompt, stream=True, temperature=0, max_tokens=10)
    messages(server, prompt, temperature=0, max_tokens=9)
    new = servers.events[name].done()[first:]
    assert len(new) == 3
    after = metric_values(server)
    for metric, field in SPEC_METRICS.items():
        moved = sum(done["speculative"][field] for done in new)
        assert after[metric] - before[metric] == moved
        # The random MTP head's drafts are rejected; the oracle's are accepted.
        assert (moved > 0) == (name == "oracle" if field == "accepted_tokens" else name != "plain")


def test_the_request_log_holds_consistent_speculative_counters(servers):
    """Every event each server wrote so far (the whole module's but the start-up tests') validates
    against the schema; the speculative servers' request_done counters are filled and
    consistent, the plain server's are the off shape."""
    prompt = "Log case: list some birds."
    reply = chat(servers["plain"], prompt, temperature=0, max_tokens=15)
    stop = (reply.reasoning + reply.text)[8:11]
    for name in servers.running:  # at least a limit and a stop (inside a round on the oracle) on each
        chat(servers[name], prompt, temperature=0, max_tokens=15)
        assert chat(servers[name], prompt, temperature=0, max_tokens=15, stop=[stop]).finish == ("stop",)
    for name, path in servers.logs.items():
        collected = servers.events[name].events
        wait_until(lambda: len(path.read_text().splitlines()) >= len(collected) + 1, timeout=30,
                   what=f"the {name} log's writer")
        events = [json.loads(line) for line in path.read_text().splitlines()]
        for event in events:
            VALIDATOR.validate(event)
        assert events[0]["event"] == "server_start"
        started = events[0]["speculative"]
        if name == "plain":
            assert started is None
        else:
            assert started == {"backend": "mtp", "draft_tokens": DRAFTS, "lm_head_draft": name == "lmhead",
                               "adaptive_drafts": True, "verify_graph_batch_sizes": []}  # no graphs on the CPU
        done = [e for e in events if e["event"] == "request_done"]
        assert len(done) >= 2, name
        # Constrained requests and those with log probabilities decode without drafts.
        plainly = {e["request_id"] for e in events if e["event"] == "request_start"
                   and (e.get("structured_output") is not None or e.get("top_logprobs") is not None)}
        for event in done:
            counters = event["speculative"]
            if event["request_id"] in plainly:
                assert counters["rounds"] == 0, event
                continue
            if name == "plain":
                assert counters == {"backend": None, "draft_window": None, "rounds": 0, "drafted_tokens": 0,
                                    "accepted_tokens": 0, "fallback_steps": 0, "accepted_per_position": []}
                continue
            assert counters["backend"] == "mtp" and counters["draft_window"] == DRAFTS
            per_position = counters["accepted_per_position"]
            assert len(per_position) == DRAFTS
            assert counters["accepted_tokens"] == sum(per_position) <= counters["drafted_tokens"]
            # A position is accepted only after the ones before it, in rounds that drafted it.
            assert counters["rounds"] >= per_position[0] and per_position == sorted(per_position, reverse=True)
            assert counters["rounds"] <= counters["drafted_tokens"] <= DRAFTS * counters["rounds"]
            completion = event["completion_tokens"]
            if completion >= 4:  # tokens 1 and 2 come without drafts, and a third when the limit is 3
                assert counters["rounds"] > 0, event
            # Every committed token after the first came from a round or a step without drafts;
            # a stop inside a round may drop accepted drafts after it.
            steps = counters["rounds"] + counters["fallback_steps"]
            if completion:
                assert steps + 1 <= completion <= 1 + steps + counters["accepted_tokens"], event
            if event["finish_reason"] == "length":
                assert completion == 1 + steps + counters["accepted_tokens"] or completion == 0, event
        if name == "oracle":
            assert sum(e["speculative"]["accepted_tokens"] for e in done) > 0
        if name == "mtp":
            assert sum(e["speculative"]["drafted_tokens"] for e in done) > 0


# ---- 7. start-up errors --------------------------------------------------------------------------


@pytest.mark.parametrize("args, option, message", [
    (["--draft-tokens", "3"], "--draft-tokens", "--draft-tokens needs --spec mtp|dflash|dflash2"),
    (["--lm-head-draft"], "--lm-head-draft", "--lm-head-draft needs --spec mtp|dflash|dflash2"),
    (["--draft-fp8"], "--draft-fp8", "--draft-fp8 needs --spec mtp|dflash|dflash2"),
    (["--spec", "mtp"], "--spec", "--spec mtp needs --draft-tokens N (1..5)"),
    (["--spec", "mtp", "--draft-tokens", "0"], "--draft-tokens", "--draft-tokens for --spec mtp must be in 1..5"),
    (["--spec", "mtp", "--draft-tokens", "6"], "--draft-tokens", "--draft-tokens for --spec mtp must be in 1..5"),
    (["--spec", "dflash", "--draft-tokens", "16"], "--draft-tokens", "--draft-tokens for --spec dflash must be in 1..15"),
])
def test_a_bad_speculative_option_stops_start_up_naming_it(mtp_artifact, capsys, args, option, message):
    assert serve_main([mtp_artifact, "--port", str(free_port()), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ninfer-serve: error: {message}"] and option in err[0]


def test_a_backend_the_artifact_lacks_stops_start_up_before_loading(tiny_qwen, mtp_artifact, capsys):
    for artifact, args, expected in (
        (tiny_qwen, ["--spec", "mtp", "--draft-tokens", "3"], f"--spec mtp: {tiny_qwen} has no MTP head"),
        (mtp_artifact, ["--spec", "dflash", "--draft-tokens", "7"],
         f"--spec dflash: {mtp_artifact}: no DFLASH drafter companion: neither {mtp_artifact}/dflash nor "
         f"{mtp_artifact}-dflash holds a config.json"),
    ):
        assert serve_main([artifact, "--port", str(free_port()), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"ninfer-serve: error: {expected}")
    with pytest.raises(SystemExit) as exit_:
        serve_main([mtp_artifact, "--spec", "medusa", "--draft-tokens", "3"])
    assert exit_.value.code == 2 and "--spec: invalid choice: 'medusa'" in capsys.readouterr().err


def test_the_process_exits_non_zero_with_one_line(tiny_qwen):
    """The installed entry point's process, on this tree's code: a non-MTP artifact with --spec mtp."""
    result = subprocess.run(
        [sys.executable, "-m", "ninfer.cli", "serve", tiny_qwen, "--port", str(free_port()),
         "--spec", "mtp", "--draft-tokens", "3"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and ": error: --spec mtp: " in lines[0] and "has no MTP head" in lines[0]
