"""A pytest plugin that records every body a protocol validator accepts, for tests/server/test_openapi.py.

Loaded with `-p tests.server.openapi_recorder` before the test modules import the validators, it
wraps them where they are defined; on exit it writes {endpoint: [body, ...]} as JSON to the file
named by NINFER_ACCEPTED_BODIES. Bodies parsed for a vision-enabled context are left out: the
served document describes this server, which has no vision input.
"""

from __future__ import annotations

import copy
import functools
import json
import os

from ninfer.server.anthropic_messages import request as messages_request
from ninfer.server.openai_chat import request as chat_request
from ninfer.server.openai_responses import request as responses_request

ACCEPTED: dict[str, list] = {}


def _recording(module, name: str, endpoint_of) -> None:
    original = getattr(module, name)

    @functools.wraps(original)
    def parse(body, context, *args, **kwargs):
        sent = copy.deepcopy(body)
        parsed = original(body, context, *args, **kwargs)
        if not context.vision_enabled:
            ACCEPTED.setdefault(endpoint_of(kwargs), []).append(sent)
        return parsed

    setattr(module, name, parse)


_recording(chat_request, "parse_chat_request", lambda kwargs: "/v1/chat/completions")
_recording(responses_request, "parse_create", lambda kwargs: "/v1/responses")
_recording(responses_request, "parse_input_tokens", lambda kwargs: "/v1/responses/input_tokens")
_recording(
    messages_request,
    "parse_messages_request",
    lambda kwargs: "/v1/messages/count_tokens" if kwargs.get("count_only") else "/v1/messages",
)


def pytest_unconfigure(config) -> None:
    with open(os.environ["NINFER_ACCEPTED_BODIES"], "w") as out:
        json.dump(ACCEPTED, out)
