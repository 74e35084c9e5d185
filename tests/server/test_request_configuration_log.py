"""request_start's resolved configuration through the official SDKs: the effort the client sent
and the tier served in all three APIs, the seed that reproduces a sampled output, the Responses
semantic-change flag and the tokenizer time; every event matches the schema."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.server.conftest import serve_config, start_server, wait_until
from tests.server.test_request_log import VALIDATOR, Collect, by_event

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def logged(tiny_qwen38):
    """A Qwen3.8-style template (low, medium and xhigh; xhigh by default) and the events it logs."""
    server = start_server(serve_config(tiny_qwen38, default_max_tokens=2))
    collect = Collect()
    server.serving.events.observers.append(collect)
    yield server, collect
    server.stop()


def starts_after(collect: Collect, count: int, expected: int = 1) -> list[dict]:
    wait_until(lambda: len(by_event(collect.events, "request_start")) >= count + expected, what="request_start")
    return by_event(collect.events, "request_start")[count:]


def efforts(collect: Collect, send) -> tuple[str | None, str | None]:
    """(requested, resolved) logged for the one request `send` makes."""
    before = len(by_event(collect.events, "request_start"))
    send()
    (start,) = starts_after(collect, before)
    return start["requested_reasoning_effort"], start["resolved_reasoning_effort"]


def test_chat_logs_the_effort_sent_and_the_tier_served(logged):
    server, collect = logged
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    model = server.serving.model_id

    def create(**extra):
        return lambda: chat.chat.completions.create(model=model, messages=HELLO, max_tokens=2, **extra)

    assert efforts(collect, create()) == (None, "xhigh")  # the template's default tier
    assert efforts(collect, create(reasoning_effort="none")) == ("none", "none")
    assert efforts(collect, create(reasoning_effort="low")) == ("low", "low")
    assert efforts(collect, create(extra_body={"enable_thinking": False})) == (None, "none")
    # OpenAI efforts map to nothing: one the template lacks is refused before preparation, unlogged.
    before = len(collect.events)
    with pytest.raises(openai.BadRequestError) as refused:
        chat.chat.completions.create(model=model, messages=HELLO, max_tokens=2, reasoning_effort="high")
    assert refused.value.code == "reasoning_effort_not_supported"
    assert not [e for e in collect.events[before:] if e["event"].startswith("request")]


def test_responses_logs_the_effort_sent_and_the_tier_served(logged):
    server, collect = logged
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    model = server.serving.model_id

    def create(**extra):
        return lambda: client.responses.create(model=model, input="hello", max_output_tokens=2, **extra)

    assert efforts(collect, create()) == (None, "xhigh")
    assert efforts(collect, create(reasoning={"effort": "none"})) == ("none", "none")
    assert efforts(collect, create(reasoning={"effort": "medium"})) == ("medium", "medium")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, input="hello", max_output_tokens=2, reasoning={"effort": "high"})
    assert refused.value.code == "reasoning_effort_not_supported"


def test_messages_logs_the_effort_sent_and_the_tier_it_was_mapped_to(logged):
    server, collect = logged
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)

    def create(**extra):
        return lambda: claude.messages.create(model="any", max_tokens=2, messages=HELLO, **extra)

    assert efforts(collect, create()) == (None, "xhigh")
    assert efforts(collect, create(thinking={"type": "disabled"})) == (None, "none")
    assert efforts(collect, create(output_config={"effort": "low"})) == ("low", "low")
    assert efforts(collect, create(output_config={"effort": "high"})) == ("high", "xhigh")  # the nearest tier
    assert efforts(collect, create(thinking={"type": "disabled"}, output_config={"effort": "high"})) == ("high", "none")


def test_the_logged_seed_reproduces_a_sampled_output(logged):
    server, collect = logged
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    model = server.serving.model_id
    before = len(by_event(collect.events, "request_start"))
    first = chat.chat.completions.create(model=model, messages=HELLO, max_tokens=12, temperature=1.0,
                                         reasoning_effort="none")
    (start,) = starts_after(collect, before)
    seed = start["sampler"]["seed"]
    assert isinstance(seed, int) and start["sampler"]["temperature"] == 1.0
    again = chat.chat.completions.create(model=model, messages=HELLO, max_tokens=12, temperature=1.0,
                                         reasoning_effort="none", seed=seed)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert first.usage.completion_tokens == 12
    (replayed,) = starts_after(collect, before + 1)
    assert replayed["sampler"]["seed"] == seed


def test_a_responses_child_that_changes_preserve_thinking_is_a_semantic_change(logged):
    server, collect = logged
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    model = server.serving.model_id
    before = len(by_event(collect.events, "request_start"))
    root = client.responses.create(model=model, input="hello", max_output_tokens=2)
    inherits = client.responses.create(model=model, input="again", max_output_tokens=2, previous_response_id=root.id)
    client.responses.create(model=model, input="and again", max_output_tokens=2, previous_response_id=inherits.id,
                            extra_body={"preserve_thinking": True})  # the server's default is off
    client.responses.create(model=model, input="once more", max_output_tokens=2, previous_response_id=root.id,
                            extra_body={"preserve_thinking": False})  # the parent's value, repeated
    starts = starts_after(collect, before, 4)
    assert [s["responses_semantic_change"] for s in starts] == [False, False, True, False]
    assert [s["preserve_thinking"] for s in starts] == [False, False, True, False]
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    chat.chat.completions.create(model=model, messages=HELLO, max_tokens=2)
    (chat_start,) = starts_after(collect, before + 4)
    assert chat_start["responses_semantic_change"] is None


def test_request_start_times_the_tokenizer_and_every_event_matches_the_schema(logged):
    server, collect = logged
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    chat.chat.completions.create(model=server.serving.model_id, messages=HELLO, max_tokens=2)
    wait_until(lambda: by_event(collect.events, "request_done"), what="a request_done")
    for start in by_event(collect.events, "request_start"):
        tokenizer = start["tokenizer"]
        assert tokenizer["encode_calls"] >= 1 and 0 < tokenizer["encode_seconds"] <= start["prepare_seconds"]
    for event in collect.events:
        VALIDATOR.validate(event)
