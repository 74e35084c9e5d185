"""GET /openapi.json against the hand-written validators, in both directions.

- Each request schema, walked member by member (tests/server/schema_examples.py): every member
  the validator reads is documented, no body off the document is accepted, and every documented
  value is accepted where the narrowed document (below) can state the validator's rules.
- Bodies generated from each request schema (narrowed by ninfer/testing/openapi_cases.py where
  JSON Schema cannot state a rule) are accepted by the endpoint's validator.
- The bodies the validators accept in the protocol test modules validate against the schema
  (recorded by running those modules with tests/server/openapi_recorder.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from jsonschema import Draft202012Validator

from ninfer.server.anthropic_messages.request import parse_messages_request
from ninfer.server.errors import APIError
from ninfer.server.http_app import create_app
from ninfer.server.openai_chat.request import parse_chat_request
from ninfer.server.openai_responses.history import build_conversation
from ninfer.server.openai_responses.request import parse_create, parse_input_tokens
from ninfer.server.openapi import openapi_document
from ninfer.server.request_context import RequestContext
from ninfer.server.validation.tools import check_template_renders_tools
from ninfer.testing.openapi_cases import accepted_document, integer_literals
from tests.server.capability_sets import CHATML, QWEN38
from tests.server.schema_examples import (
    JSON_TYPES,
    UNDOCUMENTED_READS,
    Examples,
    Recorded,
    generic,
    json_type,
    objects,
    recording,
    replaced,
)
from tests.server.conftest import serve_config, start_server

MODEL = "served-model"
REPO = Path(__file__).resolve().parents[2]
# Request schema of each body-taking endpoint.
REQUEST_SCHEMAS = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/responses": "ResponseCreateRequest",
    "/v1/responses/input_tokens": "ResponseInputTokensRequest",
    "/v1/messages": "MessagesRequest",
    "/v1/messages/count_tokens": "MessagesCountTokensRequest",
}


def _responses(parse):
    def validate(body, context):
        parsed = parse(body, context)
        conversation = build_conversation(parsed, [], None)  # the Item-history rules of routes._conversation
        check_template_renders_tools(conversation, context.capabilities, "tools" if conversation.tools else "input")

    return validate


VALIDATORS = {
    "/v1/chat/completions": parse_chat_request,
    "/v1/responses": _responses(parse_create),
    "/v1/responses/input_tokens": _responses(parse_input_tokens),
    "/v1/messages": parse_messages_request,
    "/v1/messages/count_tokens": lambda body, context: parse_messages_request(body, context, count_only=True),
}


def schema_validator(document: dict, name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": document["components"]})


@pytest.fixture(scope="module")
def served_document() -> dict:
    return openapi_document()


def _routes(app) -> set[tuple[str, str]]:
    while not isinstance(app, FastAPI):  # under the middleware
        app = app.app
    return {
        (route.path.replace(":path}", "}"), method.lower())
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in route.methods
    }


def test_served_without_the_key_and_covering_every_route(tiny_qwen, served_document):
    Draft202012Validator.check_schema({"components": served_document["components"]})
    refs = json.dumps(served_document).split('"$ref": "#/components/schemas/')[1:]
    assert {ref.split('"')[0] for ref in refs} <= set(served_document["components"]["schemas"])
    server = start_server(serve_config(tiny_qwen, api_key="secret"))
    try:
        response = httpx.get(server.base_url + "/openapi.json")
        assert response.status_code == 200 and response.json() == served_document
        assert httpx.get(server.base_url + "/v1/models").status_code == 401
        documented = {(path, method) for path, item in served_document["paths"].items() for method in item}
        assert documented == _routes(create_app(server.serving))
    finally:
        server.stop()


# Bodies per endpoint and template: a quick pass in the fast suite, more in the slow one.
@pytest.mark.parametrize("examples", [20, pytest.param(75, marks=pytest.mark.slow)], ids=["quick", "thorough"])
@pytest.mark.parametrize("caps", [QWEN38, pytest.param(CHATML, marks=pytest.mark.slow)], ids=["qwen3.8", "chatml"])
@pytest.mark.parametrize("vision", [False, True], ids=["text", "vision"])
@pytest.mark.parametrize("path", REQUEST_SCHEMAS)
def test_generated_bodies_are_accepted(path, vision, caps, examples):
    hypothesis = pytest.importorskip("hypothesis")
    schemathesis = pytest.importorskip("schemathesis")

    operation = schemathesis.openapi.from_dict(accepted_document(caps, MODEL, vision=vision))[path]["POST"]
    served = schema_validator(openapi_document(vision=vision), REQUEST_SCHEMAS[path])
    context = RequestContext(model_id=MODEL, capabilities=caps, vision_enabled=vision)

    @hypothesis.settings(max_examples=examples, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(operation.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE))
    def accepted(case):
        assert not list(served.iter_errors(case.body)), "narrowing must only narrow the served schema"
        body = integer_literals(case.body)  # 4.0 where an integer goes is refused (a test below)
        try:
            VALIDATORS[path](body, context)
        except APIError as error:
            body = json.dumps(body)[:2000]
            raise AssertionError(f"{error.code} {error.param}: {error.message}\n{body}") from None

    accepted()


@pytest.mark.parametrize(
    "path, body, read",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4.0, "top_k": 5.0},
         lambda parsed: (parsed.max_tokens, parsed.sampling.top_k)),
        ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 4.0, "max_tool_calls": 2.0},
         lambda parsed: (parsed.max_output_tokens, parsed.echo["max_tool_calls"])),
        ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4.0,
                          "top_k": 5.0}, lambda parsed: (parsed.max_tokens, parsed.sampling.top_k)),
    ],
)
def test_whole_numbers_written_with_a_fraction_are_refused(path, body, read):
    # OpenAI and Anthropic refuse 4.0 where an integer goes; so do we, naming the field. (JSON
    # Schema's integer would take it: the generators only ever produce integer literals.)
    parse = {"/v1/chat/completions": parse_chat_request, "/v1/responses": parse_create,
             "/v1/messages": parse_messages_request}[path]
    with pytest.raises(APIError) as refused:
        parse(body, RequestContext(model_id=MODEL, capabilities=QWEN38))
    assert refused.value.code == "invalid_type" and refused.value.param
    whole = {key: int(value) if isinstance(value, float) else value for key, value in body.items()}
    values = read(parse(whole, RequestContext(model_id=MODEL, capabilities=QWEN38)))
    assert values in ((4, 5), (4, 2)) and all(type(value) is int for value in values)


# The protocol test modules whose accepted bodies are checked against the schema.
RECORDED_MODULES = [
    "tests/server/test_openai_chat_request.py",
    "tests/server/test_openai_responses_request.py",
    "tests/server/test_anthropic_messages_request.py",
]


@pytest.mark.slow
def test_bodies_the_validators_accept_in_the_tests_match_the_schema(tmp_path, served_document):
    recorded = tmp_path / "accepted.json"
    result = subprocess.run(
        # In this one process (no workers from addopts), where the recorder sees every parse.
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "tests.server.openapi_recorder", "-p", "no:cacheprovider",
         "-o", "addopts=", *RECORDED_MODULES],
        cwd=REPO, env={**os.environ, "NINFER_ACCEPTED_BODIES": str(recorded)}, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    accepted = json.loads(recorded.read_text())
    assert set(accepted) == set(REQUEST_SCHEMAS)
    mismatches = []
    for path, bodies in accepted.items():
        validator = schema_validator(served_document, REQUEST_SCHEMAS[path])
        for body in bodies:
            errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in validator.iter_errors(body)]
            if errors:
                mismatches.append(f"{path}: {errors}\n  {json.dumps(body)[:500]}")
    assert not mismatches, f"{len(mismatches)} accepted bodies off the schema:\n" + "\n".join(mismatches[:20])


PNG = "data:image/png;base64,iVBORw0KGgo="
MEDIA_BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Compare"},
                                     {"type": "image_url", "image_url": {"url": PNG, "detail": "auto"}},
                                     {"type": "image_url", "image_url": "https://example.com/a.png"},
                                     {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}]},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "shot", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "image_url", "image_url": PNG}]}],
        "tools": [{"type": "function", "function": {"name": "shot", "parameters": {"type": "object"}}}]},
    "/v1/responses": {"model": MODEL, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is shown?"},
                                     {"type": "input_image", "image_url": PNG, "detail": "auto"},
                                     {"type": "input_video", "video_url": "https://example.com/v.mp4"}]},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image", "image_url": PNG}]}],
        "tools": [{"type": "function", "name": "shot", "parameters": {"type": "object"}}]},
    "/v1/messages": {"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": "iVBORw0KGgo="}},
                                     {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
                                     {"type": "text", "text": "Describe"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/b.png"}}]}]}],
        "tools": [{"name": "shot", "input_schema": {"type": "object"}}]},
}


@pytest.mark.parametrize("path", MEDIA_BODIES)
def test_media_parts_are_documented_on_a_vision_server_only(path):
    """Every media shape the validators take with --vision matches the vision document, and the
    text-only document (a server without --vision, which refuses them) leaves them out."""
    body = MEDIA_BODIES[path]
    name = REQUEST_SCHEMAS[path]
    assert not list(schema_validator(openapi_document(vision=True), name).iter_errors(body))
    assert list(schema_validator(openapi_document(), name).iter_errors(body))
    VALIDATORS[path](body, RequestContext(model_id=MODEL, capabilities=QWEN38, vision_enabled=True))
    with pytest.raises(APIError) as refused:
        VALIDATORS[path](body, RequestContext(model_id=MODEL, capabilities=QWEN38))
    assert refused.value.code == "vision_disabled"


def _probes(examples: Examples, node: Recorded) -> dict[str, list]:
    """The values to try in each member of an object: the schema's own (every branch and enum
    value), a value of each JSON type the schema has none of, and the numbers just past its bounds."""
    schema = node.schema or {}
    members = dict(schema.get("properties", {}))
    if isinstance(schema.get("additionalProperties"), dict):
        members["key"] = schema["additionalProperties"]  # a map: one member of any name
    probes = {}
    for key, member in members.items():
        values = examples.instances(member, f"{node.origin}.{key}")
        kinds = {json_type(value) for value in values}
        values += [generic(kind) for kind in JSON_TYPES if kind not in kinds]
        for branch in [examples.merged(member), *map(examples.merged, examples.merged(member).get("anyOf", []))]:
            values += [branch["minimum"] - 1] if "minimum" in branch else []
            values += [branch["maximum"] + 1] if "maximum" in branch else []
        probes[key] = values
    return probes


def _walk(examples: Examples, bodies: list, probe) -> None:
    """Set each member of each kind of object in the bodies to each of its probe values, one at a
    time; `probe(member, origin, value, body)` says whether the body may be walked in turn (it is,
    once, when its value holds kinds of objects not seen before)."""
    queue, probed, kinds = list(bodies), set(), set()
    while queue:
        base = queue.pop(0)
        for where, node in objects(base):
            for key, values in _probes(examples, node).items():
                if (node.origin, key) in probed:
                    continue
                probed.add((node.origin, key))
                for value in values:
                    body = replaced(base, where, key, value)
                    new = {inner.origin for _, inner in objects(value)} - kinds
                    if probe((*where, key), node.origin, value, body) and new:
                        kinds |= new
                        queue.append(body)


@pytest.mark.parametrize("vision", [False, True], ids=["text", "vision"])
@pytest.mark.parametrize("path", REQUEST_SCHEMAS)
def test_the_document_and_the_validator_agree_member_by_member(path, vision):
    """Walk the request schema, setting one member at a time. Every member the validator reads in a
    documented body is one the schema names at that place; no body off the document is accepted (a
    value of another JSON type, past a bound, outside an enum); every value of every documented
    member is accepted where JSON Schema can state the validator's rules (the narrowed document)."""
    name = REQUEST_SCHEMAS[path]
    narrowed, served = accepted_document(QWEN38, MODEL, vision=vision), openapi_document(vision=vision)
    admits_narrowed, admits_served = schema_validator(narrowed, name), schema_validator(served, name)
    context = RequestContext(model_id=MODEL, capabilities=QWEN38, vision_enabled=vision)
    UNDOCUMENTED_READS.clear()
    disagreements = []

    def check(member: tuple, origin: str, value, body) -> bool:
        documented = admits_served.is_valid(body)
        with recording(documented):  # refusing a body off the document may look at anything
            try:
                VALIDATORS[path](body, context)
                error = None
            except APIError as refused:
                error = refused
        where = f"{'.'.join(map(str, member))} ({origin}) = {value!r}"
        if error is not None and admits_narrowed.is_valid(body):
            disagreements.append(f"{where} is documented but refused: {error.code} {error.param}: "
                                 f"{error.message[:160]}")
        if error is None and not documented:
            disagreements.append(f"{where} is accepted but not documented")
        return documented

    examples = Examples(narrowed)
    for base in examples.of(name):
        assert admits_narrowed.is_valid(base), json.dumps(base)[:500]
        check((), name, "generated", base)
    _walk(examples, examples.of(name), check)
    # Every branch of the served document too (bodies cross-field rules refuse still show their reads).
    served_examples = Examples(served)
    _walk(served_examples, served_examples.of(name), check)
    disagreements += sorted(f"{origin}.{key} is read but not documented" for origin, key in UNDOCUMENTED_READS)
    assert not disagreements, f"{len(disagreements)} disagreements:\n" + "\n".join(disagreements)
