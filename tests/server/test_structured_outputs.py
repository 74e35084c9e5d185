"""Structured outputs, forced and strict tool calls, and log probabilities through the official SDKs.

One server on the tiny Qwen3.5 artifact (real tokenizer and template) whose model likes to close
what it opened (tests/preference_model.py), so every constrained answer finishes: the SDKs'
`parse()` helpers return valid instances, forced and strict calls parse and validate in all three
APIs, log probabilities equal the log-softmax of the logits the sampler was handed, and schemas
the grammar cannot hold are 400s naming their field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel

from ninfer.engine.core import EngineCore
from ninfer.server.served_model import ServedModel
from tests.preference_model import PreferenceLM, qwen_preferences
from tests.server.conftest import RunningServer, serve_config, start_server, wait_until

LOG_SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "request-log.schema.json").read_text())

NO_THINKING = {"enable_thinking": False}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
SEARCH_PARAMETERS = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 12}, "limit": {"type": "integer"}},
    "required": ["query"],
}
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "search": SEARCH_PARAMETERS}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS, "strict": True}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH_PARAMETERS}},
]
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in CHAT_TOOLS]
MESSAGES_TOOLS = [
    {"name": "get_weather", "input_schema": WEATHER_PARAMETERS, "strict": True},
    {"name": "search", "input_schema": SEARCH_PARAMETERS},
]


class Weather(BaseModel):
    city: str
    celsius: int
    sky: Literal["sunny", "cloudy", "rain"]
    tags: list[str]


@pytest.fixture(scope="module")
def log_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("structured-log") / "requests.jsonl"


@pytest.fixture(scope="module")
def server(tiny_qwen, log_path) -> Iterator[RunningServer]:
    config = serve_config(tiny_qwen, max_concurrency=2, default_max_tokens=200, default_thinking_budget=2,
                          request_log_jsonl=str(log_path))

    def build(serving: ServedModel) -> EngineCore:
        tokenizer = serving.artifact.tokenizer
        liked, follows = qwen_preferences(tokenizer)
        return EngineCore(PreferenceLM(serving.artifact.config.vocab_size, liked, follows), tokenizer, config.engine)

    running = start_server(config, build)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)


def model(server) -> str:
    return server.serving.model_id


# ---- JSON answers --------------------------------------------------------------------------------


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_parse_returns_a_valid_instance(server, oai, thinking) -> None:
    """With thinking, the reasoning runs free until the server's small thinking budget closes it
    (this model would not close it itself); the grammar starts after </think>."""
    completion = oai.chat.completions.parse(
        model=model(server), messages=QUESTION, response_format=Weather, seed=3,
        **({"temperature": 0} if thinking else {}), extra_body={"enable_thinking": thinking},
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Weather), message.content
    assert completion.choices[0].finish_reason == "stop"
    if thinking:
        assert "limited time" in message.reasoning_content


def test_chat_json_object_mode_streams_one_object(server, oai) -> None:
    stream = oai.chat.completions.create(
        model=model(server), messages=QUESTION, response_format={"type": "json_object"}, stream=True, seed=4,
        extra_body=NO_THINKING,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), dict)


def test_responses_parse_returns_a_valid_instance(server, oai) -> None:
    response = oai.responses.parse(
        model=model(server), input="Weather in Oslo?", text_format=Weather, reasoning={"effort": "none"}
    )
    assert isinstance(response.output_parsed, Weather)
    assert response.text.format.type == "json_schema"


def test_messages_parse_returns_a_valid_instance(server, claude) -> None:
    message = claude.messages.parse(
        model="any", max_tokens=200, messages=QUESTION, output_format=Weather, thinking={"type": "disabled"}
    )
    assert isinstance(message.parsed_output, Weather)


# ---- forced and strict tool calls ------------------------------------------------------------------


def check_arguments(name: str, arguments: dict | str) -> None:
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, SCHEMAS[name])


@pytest.mark.parametrize(
    "tool_choice, names",
    [("required", None), ({"type": "function", "function": {"name": "search"}}, ["search"])],
)
def test_chat_forced_calls_parse_and_validate(server, oai, tool_choice, names) -> None:
    completion = oai.chat.completions.create(
        model=model(server), messages=QUESTION, tools=CHAT_TOOLS, tool_choice=tool_choice, seed=5,
        extra_body=NO_THINKING,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_arguments(call.function.name, call.function.arguments)
    if names is not None:
        assert [call.function.name for call in choice.message.tool_calls] == names


def test_chat_forced_calls_stream_and_parse_with_pydantic_tools(server, oai) -> None:
    class Lookup(BaseModel):
        term: str
        exact: bool

    tools = [openai.pydantic_function_tool(Lookup)]
    completion = oai.chat.completions.parse(
        model=model(server), messages=QUESTION, tools=tools, tool_choice="required", parallel_tool_calls=False,
        extra_body=NO_THINKING,
    )
    calls = completion.choices[0].message.tool_calls
    assert len(calls) == 1 and isinstance(calls[0].function.parsed_arguments, Lookup)
    stream = oai.chat.completions.create(
        model=model(server), messages=QUESTION, tools=CHAT_TOOLS, tool_choice="required", stream=True, seed=6,
        extra_body=NO_THINKING,
    )
    arguments: dict[int, list] = {}
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = arguments.setdefault(delta.index, [None, ""])
            entry[0] = entry[0] or (delta.function.name if delta.function else None)
            entry[1] += delta.function.arguments or "" if delta.function else ""
    assert arguments
    for name, text in arguments.values():
        check_arguments(name, text)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_responses_forced_calls_parse_and_validate(server, oai, tool_choice) -> None:
    # Neither API takes a seed, and a forced choice may call several times: room for many calls,
    # so that the output limit (the server's default is 200 tokens) never cuts one short.
    response = oai.responses.create(
        model=model(server), input="Weather in Oslo?", tools=RESPONSES_TOOLS, tool_choice=tool_choice,
        reasoning={"effort": "none"}, max_output_tokens=2048,
    )
    assert response.status == "completed", response.incomplete_details
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(item.type in ("function_call", "reasoning") for item in response.output)
    for call in calls:
        check_arguments(call.name, call.arguments)
    if isinstance(tool_choice, dict):
        assert [call.name for call in calls] == ["get_weather"]


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "search"}])
def test_messages_forced_tool_use_parses_and_validates(server, claude, tool_choice) -> None:
    message = claude.messages.create(  # room for several calls, as above
        model="any", max_tokens=2048, messages=QUESTION, tools=MESSAGES_TOOLS, tool_choice=tool_choice,
        thinking={"type": "disabled"},
    )
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses
    for block in uses:
        check_arguments(block.name, block.input)
    if tool_choice["type"] == "tool":
        assert [block.name for block in uses] == ["search"]


def test_strict_tools_under_auto_choice_validate_when_called(server, oai, claude) -> None:
    """The model may answer or call; whichever calls come back validate (six tries, varied seeds)."""
    called = 0
    for seed in range(3):
        completion = oai.chat.completions.create(
            model=model(server), messages=QUESTION, tools=CHAT_TOOLS[:1], seed=seed, temperature=1.0,
            extra_body=NO_THINKING,
        )
        for call in completion.choices[0].message.tool_calls or []:
            check_arguments(call.function.name, call.function.arguments)
            called += 1
        message = claude.messages.create(
            model="any", max_tokens=200, messages=[{"role": "user", "content": f"Weather, take {seed}?"}],
            tools=MESSAGES_TOOLS[:1], thinking={"type": "disabled"}, extra_body={"temperature": 1.0},
        )
        for block in message.content:
            if block.type == "tool_use":
                check_arguments(block.name, block.input)
                called += 1
    assert called >= 1


# ---- log probabilities ---------------------------------------------------------------------------------


def test_chat_logprobs_are_the_log_softmax_of_the_sampled_logits(server, oai, monkeypatch) -> None:
    runner = server.core.runner
    seen: list[tuple[torch.Tensor, int]] = []
    sample = runner.sampler.sample

    def recording(logits, batch):
        ids = sample(logits, batch)
        masked = runner.sampler.apply_token_bitmask(logits, batch.token_bitmask) if batch.token_bitmask is not None else logits
        seen.append((torch.log_softmax(masked[0].double(), dim=-1), int(ids[0])))
        return ids

    monkeypatch.setattr(runner.sampler, "sample", recording)
    options = dict(model=model(server), messages=QUESTION, logprobs=True, top_logprobs=3, temperature=0,
                   response_format={"type": "json_object"}, extra_body=NO_THINKING)
    completion = oai.chat.completions.create(**options)
    monkeypatch.undo()
    choice = completion.choices[0]
    entries = choice.logprobs.content
    # Every sampled token but the end of the turn is an answer token.
    assert len(seen) == len(entries) + 1
    for entry, (reference, token) in zip(entries, seen):
        assert entry.logprob == pytest.approx(float(reference[token]), abs=1e-5)
        values = torch.topk(reference, 3).values.tolist()
        assert [top.logprob for top in entry.top_logprobs] == pytest.approx(values[: len(entry.top_logprobs)], abs=1e-5)
        assert entry.logprob >= entry.top_logprobs[-1].logprob - 1e-6
    assert bytes(b for entry in entries for b in entry.bytes).decode() == choice.message.content
    stream = oai.chat.completions.create(**options, stream=True)
    streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_responses_logprobs_ride_with_the_output_text(server, oai) -> None:
    options = dict(model=model(server), input="Weather in Oslo?", reasoning={"effort": "none"}, temperature=0,
                   include=["message.output_text.logprobs"], top_logprobs=2, max_output_tokens=12)
    response = oai.responses.create(**options)
    part = response.output[-1].content[0]
    assert part.logprobs and all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    assert response.top_logprobs == 2
    deltas = [event for event in oai.responses.create(**options, stream=True) if event.type == "response.output_text.delta"]
    assert [e.token for event in deltas for e in event.logprobs] == [e.token for e in part.logprobs]
    plain = oai.responses.create(**{**options, "include": None, "top_logprobs": None})
    assert getattr(plain.output[-1].content[0], "logprobs", None) in (None, [])


# ---- schemas the grammar cannot hold ------------------------------------------------------------------


def test_uncompilable_schemas_are_400s_naming_their_field(server) -> None:
    base = {"model": model(server), "messages": QUESTION}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
         "response_format.json_schema.schema"),
        ({"tools": [CHAT_TOOLS[0], {"type": "function", "function": {
            "name": "bad", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/missing"}}}}}],
          "tool_choice": "required"}, "tools[1].function.parameters"),
        ({"tools": [{"type": "function", "function": {
            "name": "odd", "strict": True, "parameters": {"type": "object", "properties": {"a>b": {}}}}}]},
         "tools[0].function.parameters.properties"),
    ]
    for extra, param in cases:
        resp = httpx.post(server.base_url + "/v1/chat/completions", json={**base, **extra}, timeout=60)
        error = resp.json()["error"]
        assert resp.status_code == 400 and (error["param"], error["code"], error["type"]) == (
            param, "invalid_schema", "invalid_request_error"), error
        assert param in error["message"]
    resp = httpx.post(server.base_url + "/v1/messages", timeout=60, json={
        "model": "any", "max_tokens": 10, "messages": QUESTION,
        "output_config": {"format": {"type": "json_schema", "schema": {"$ref": "#/nope"}}}})
    assert resp.status_code == 400 and "output_config.format.schema" in resp.json()["error"]["message"]


def test_the_request_log_names_the_grammar_and_the_log_probabilities(server, oai, log_path) -> None:
    oai.chat.completions.create(model=model(server), messages=QUESTION, logprobs=True, top_logprobs=1, max_tokens=3,
                                extra_body=NO_THINKING)

    def starts() -> list[dict]:
        lines = log_path.read_text().splitlines() if log_path.exists() else []
        return [event for event in map(json.loads, lines) if event["event"] == "request_start"]

    wait_until(lambda: any(event["top_logprobs"] == 1 for event in starts()), what="the logged request_start")
    validator = jsonschema.Draft202012Validator(LOG_SCHEMA)
    for event in starts():
        validator.validate(event)
    kinds = {event["structured_output"] for event in starts()}
    assert {"json", "tool_calls", None} <= kinds
