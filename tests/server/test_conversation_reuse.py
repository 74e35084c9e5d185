"""Extending a conversation at the default capacities (one lane) reuses its prefix, in all three
APIs, with thinking on and off and preserve_thinking on and off. The Qwen template drops the
closed turn's reasoning from history, so the next prompt diverges inside the previous one: the
turn-closure checkpoint is what it resumes from, and at one lane that checkpoint lives in the
pinned host tier by then."""

from __future__ import annotations

import logging
import re

import anthropic
import openai
import pytest

from tests.server.conftest import scripted_server

LONG_NOTE = "Please keep these notes in mind. " + " ".join(f"note {i} is about topic {i % 7}." for i in range(60))
FOLLOW_UP = "Now summarise them in one line."
REASONING = "Let me weigh the notes."
ANSWER = "The notes cover seven topics."
# The generation prologue and assistant opener the turn closure sits before: a few tokens.
MAX_PROLOGUE_TOKENS = 8


def script(thinking: bool) -> str:
    return f"{REASONING}\n</think>\n\n{ANSWER}" if thinking else ANSWER


def reuse_paths(caplog) -> list[str]:
    """The reuse path of each completion record, in order."""
    return [m.group(1) for r in caplog.records if (m := re.search(r"\(cache \d+, \d+%, ([a-z ]+)\)", r.getMessage()))]


# The fast loop runs the Chat case with thinking on; the whole suite runs them all (a server each).
SLOW = pytest.mark.slow


@pytest.fixture(params=[True, pytest.param(False, marks=SLOW)], ids=["thinking", "no-thinking"])
def thinking(request) -> bool:
    return request.param


@pytest.fixture(params=[False, pytest.param(True, marks=SLOW)], ids=["drop-reasoning", "preserve-thinking"])
def preserve(request) -> bool:
    return request.param


@pytest.fixture
def server(tiny_qwen, thinking):
    # Engine defaults (--max-concurrency 1, default device and host state slots) with a context that
    # holds a first turn's checkpoints beside the next turn's full output reservation.
    running = scripted_server(tiny_qwen, script(thinking), default_max_tokens=48, max_context=4096)
    yield running
    running.stop()


def assert_extension_reused(first_prompt_tokens: int, cached: int, caplog) -> None:
    assert first_prompt_tokens > 150  # long enough that the bound below means something
    assert first_prompt_tokens - MAX_PROLOGUE_TOKENS <= cached, (first_prompt_tokens, cached)
    assert reuse_paths(caplog)[-1] != "root"


def test_chat_extension(server, thinking, preserve, caplog):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    options = {"enable_thinking": thinking, "preserve_thinking": preserve}
    history = [{"role": "user", "content": LONG_NOTE}]
    caplog.set_level(logging.INFO, logger="ninfer")
    first = client.chat.completions.create(model=server.serving.model_id, messages=history, extra_body=options)
    assert first.choices[0].message.content == ANSWER
    assistant = {"role": "assistant", "content": ANSWER}
    if thinking:
        assert first.choices[0].message.model_extra["reasoning_content"].strip() == REASONING
        assistant["reasoning_content"] = REASONING
    second = client.chat.completions.create(
        model=server.serving.model_id,
        messages=[*history, assistant, {"role": "user", "content": FOLLOW_UP}],
        extra_body=options,
    )
    assert second.choices[0].message.content == ANSWER
    assert_extension_reused(first.usage.prompt_tokens, second.usage.prompt_tokens_details.cached_tokens, caplog)
    assert server.core.pool_accounting()["running"] == 0


@SLOW
def test_responses_chain_extension(server, thinking, caplog):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    effort = {} if thinking else {"reasoning": {"effort": "none"}}  # the server thinks by default
    caplog.set_level(logging.INFO, logger="ninfer")
    root = client.responses.create(model=server.serving.model_id, input=LONG_NOTE, **effort)
    assert root.output_text == ANSWER
    child = client.responses.create(
        model=server.serving.model_id, input=FOLLOW_UP, previous_response_id=root.id, **effort
    )
    assert child.output_text == ANSWER
    assert_extension_reused(root.usage.input_tokens, child.usage.input_tokens_details.cached_tokens, caplog)


@SLOW
def test_messages_extension(server, thinking, caplog):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    mode = {"thinking": {"type": "enabled", "budget_tokens": 1024} if thinking else {"type": "disabled"}}
    history = [{"role": "user", "content": LONG_NOTE}]
    caplog.set_level(logging.INFO, logger="ninfer")
    first = client.messages.create(model=server.serving.model_id, max_tokens=1100, messages=history, **mode)
    assert first.content[-1].text == ANSWER
    second = client.messages.create(
        model=server.serving.model_id,
        max_tokens=1100,
        messages=[*history, {"role": "assistant", "content": first.content}, {"role": "user", "content": FOLLOW_UP}],
        **mode,
    )
    assert second.content[-1].text == ANSWER
    first_prompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert_extension_reused(first_prompt, second.usage.cache_read_input_tokens, caplog)


@SLOW
def test_an_edited_last_message_resumes_from_a_long_anchor(tiny_qwen, caplog):
    # A long conversation whose last user message is edited and resent (a retry): the turn
    # closure lies after the edit, so the long anchor at that message's start is what reuses.
    server = scripted_server(tiny_qwen, ANSWER, default_max_tokens=16, max_context=16384, prefill_chunk=512)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        history = [{"role": "system", "content": LONG_NOTE * 4}]
        for turn in range(3):
            history += [{"role": "user", "content": f"Turn {turn}. " + LONG_NOTE * 3},
                        {"role": "assistant", "content": ANSWER}]
        caplog.set_level(logging.INFO, logger="ninfer")
        options = {"enable_thinking": False}
        first = client.chat.completions.create(
            model=server.serving.model_id, messages=[*history, {"role": "user", "content": "Question " + LONG_NOTE}],
            extra_body=options)
        edited = client.chat.completions.create(
            model=server.serving.model_id, messages=[*history, {"role": "user", "content": "Edited " + LONG_NOTE}],
            extra_body=options)
        assert first.usage.prompt_tokens > 4096
        cached = edited.usage.prompt_tokens_details.cached_tokens
        last_message = first.usage.prompt_tokens - cached  # what was recomputed: the edited message onwards
        assert 0 < last_message < 700, (first.usage.prompt_tokens, cached)  # the last message is ~600 tokens
        assert reuse_paths(caplog)[-1] == "private long anchor"
    finally:
        server.stop()
