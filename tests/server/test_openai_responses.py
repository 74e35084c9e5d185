"""OpenAI Responses Core end to end: the official openai SDK and raw httpx SSE against real servers
(tiny random Qwen3.5 for lifecycle and reuse, the scripted model for reasoning and tool calls)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent

from ninfer.contract.messages import Abort
from ninfer.server.openai_responses.store import session_key_for
from tests.server.conftest import scripted_server, serve_config, start_server, wait_until

STREAM_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
ITEM = pydantic.TypeAdapter(ResponseItem)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    "strict": False,
}
CLOCK = {
    "type": "namespace",
    "name": "mcp__clock",
    "description": "Clock service",
    "tools": [{"type": "function", "name": "now", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}],
}
SCRIPT = (
    "The user wants weather and time.\n</think>\n\nChecking both.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=mcp__clock__now>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"
)


def validate_response(raw: dict) -> Response:
    """Response.model_validate, except for one documented divergence: this SDK release requires
    usage.input_tokens_details.cache_write_tokens, which NInfer's checkpoint-native usage leaves
    out (NInfer cannot prove how many tokens a capture hint wrote)."""
    usage = raw.get("usage")
    if usage is not None:
        assert set(usage["input_tokens_details"]) == {"cached_tokens"}
        raw = {**raw, "usage": {**usage, "input_tokens_details": {**usage["input_tokens_details"],
                                                                   "cache_write_tokens": 0}}}
    return Response.model_validate(raw)


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, JSON payload) of each SSE frame; comments and blank lines skipped."""
    events: list[tuple[str, dict]] = []
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            assert line != "data: [DONE]", "Responses SSE has no [DONE] sentinel"
            events.append((name, json.loads(line[len("data: "):])))
            name = None
    return events


def stream_body(server, body: dict) -> tuple[httpx.Response, list[tuple[str, dict]]]:
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        return resp, sse_events(resp)


def check_stream(events: list[tuple[str, dict]]) -> dict:
    """Every lifecycle rule of Responses SSE; returns the terminal Response object."""
    names = [name for name, _ in events]
    for name, payload in events[:-1]:
        assert name == payload["type"]
        STREAM_EVENT.validate_python(payload)
    assert events[-1][0] == events[-1][1]["type"]
    assert [payload["sequence_number"] for _, payload in events] == list(range(len(events)))
    assert names[:2] == ["response.created", "response.in_progress"]
    terminals = [n for n in names if n in ("response.completed", "response.incomplete", "response.failed")]
    assert len(terminals) == 1 and names[-1] == terminals[0]
    final = events[-1][1]["response"]
    validate_response(final)
    assert events[0][1]["response"]["id"] == final["id"] and events[0][1]["response"]["status"] == "in_progress"

    # Per output Item: added, its parts and deltas, then done; deltas concatenate to the terminal Item.
    for index, item in enumerate(final["output"]):
        mine = [(n, p) for n, p in events if p.get("output_index") == index]
        assert mine[0][0] == "response.output_item.added" and mine[-1][0] == "response.output_item.done"
        assert all(p.get("item_id", item["id"]) == item["id"] for _, p in mine)
        assert mine[0][1]["item"]["id"] == item["id"] and mine[-1][1]["item"] == item
        deltas = "".join(p["delta"] for n, p in mine if n.endswith(".delta"))
        if item["type"] == "function_call":
            assert deltas == item["arguments"]
            assert [n for n, _ in mine][-2] == "response.function_call_arguments.done"
        else:
            (part,) = item["content"]
            assert deltas == part["text"]
            kinds = [n for n, _ in mine]
            assert kinds[1] == "response.content_part.added" and kinds[-2] == "response.content_part.done"
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            assert kinds[-3] == done
    # Items are announced in output order and each closes before the next opens.
    added = [p["output_index"] for n, p in events if n == "response.output_item.added"]
    closed = [p["output_index"] for n, p in events if n == "response.output_item.done"]
    assert added == closed == list(range(len(final["output"])))
    return final


@pytest.fixture(scope="module")
def server(tiny_qwen) -> Iterator:
    running = start_server(serve_config(tiny_qwen, max_concurrency=2, default_max_tokens=16, device_state_slots=6))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def tools_server(tiny_qwen) -> Iterator:
    running = scripted_server(tiny_qwen, SCRIPT, default_max_tokens=200, device_state_slots=4)
    yield running
    running.stop()


def test_aggregate_response_object(server):
    model = server.serving.model_id
    body = {"model": model, "input": "Say something about prefix caching.", "instructions": "Be terse.",
            "metadata": {"k": "v"}, "client_metadata": {"trace": {"id": 1}}, "service_tier": "auto"}
    resp = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
    assert resp.status_code == 200 and resp.headers["x-request-id"]
    raw = resp.json()
    parsed = validate_response(raw)
    assert raw["id"].startswith("resp_") and raw["object"] == "response" and "output_text" not in raw
    assert raw["model"] == model and raw["instructions"] == "Be terse." and raw["metadata"] == {"k": "v"}
    assert raw["max_output_tokens"] is None  # defaulted: executed with --default-max-tokens, reported null
    assert raw["service_tier"] == "default" and raw["truncation"] == "disabled" and raw["store"] is True
    assert raw["tools"] == [] and raw["tool_choice"] == "auto" and raw["parallel_tool_calls"] is True
    assert raw["text"] == {"format": {"type": "text"}} and raw["previous_response_id"] is None
    assert raw["background"] is False and raw["error"] is None
    usage = raw["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert 0 < usage["output_tokens"] <= 16
    assert 0 <= usage["output_tokens_details"]["reasoning_tokens"] <= usage["output_tokens"]
    if raw["status"] == "completed":
        assert raw["completed_at"] >= raw["created_at"] and raw["incomplete_details"] is None
    else:
        assert raw["status"] == "incomplete" and raw["completed_at"] is None
        assert raw["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in raw["output"]][:1] in (["reasoning"], ["message"])
    for item in raw["output"]:
        if item["type"] == "reasoning":
            assert item["id"].startswith("rs_") and item["summary"] == []
            assert item["content"][0]["type"] == "reasoning_text"
        if item["type"] == "message":
            assert item["id"].startswith("msg_") and item["content"][0]["annotations"] == []
    assert parsed.output_text == "".join(
        part["text"] for item in raw["output"] if item["type"] == "message" for part in item["content"]
    )
    # The SDK sees the same stored object.
    assert httpx.get(f"{server.base_url}/v1/responses/{raw['id']}").json() == raw


def test_reasoning_only_incomplete_has_no_invented_message(server):
    # Thinking is on by default: a 3-token budget ends inside the reasoning channel.
    resp = client_for(server).responses.create(
        model=server.serving.model_id, input="Think about it.", max_output_tokens=3
    )
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.max_output_tokens == 3 and resp.completed_at is None
    assert [item.type for item in resp.output] == ["reasoning"]
    assert resp.output[0].status == "incomplete"
    assert resp.usage.output_tokens == 3 == resp.usage.output_tokens_details.reasoning_tokens


def test_zero_output_tokens_processes_the_prompt_only(server):
    resp = client_for(server).responses.create(model=server.serving.model_id, input="Hi", max_output_tokens=0)
    assert resp.status == "incomplete" and resp.output == [] and resp.usage.output_tokens == 0


def test_stream_lifecycle_raw_and_sdk(server):
    model = server.serving.model_id
    body = {"model": model, "input": "Stream please.", "max_output_tokens": 10, "stream": True,
            "stream_options": {"include_obfuscation": False}, "temperature": 0.7, "top_p": 0.9}
    resp, events = stream_body(server, body)
    final = check_stream(events)
    assert final["temperature"] == 0.7 and final["top_p"] == 0.9 and final["max_output_tokens"] == 10
    assert final["usage"]["output_tokens"] == 10 and final["status"] == "incomplete"
    assert resp.headers["x-request-id"]
    assert not any("obfuscation" in payload for _, payload in events)
    # The streamed terminal object is what GET returns.
    assert httpx.get(f"{server.base_url}/v1/responses/{final['id']}").json() == final

    stream = client_for(server).responses.create(model=model, input="Stream please.", max_output_tokens=6,
                                                 stream=True)
    typed = list(stream)
    assert typed[0].type == "response.created" and typed[-1].type == "response.incomplete"
    assert [e.sequence_number for e in typed] == list(range(len(typed)))


def test_chain_continuation_reuses_the_stored_prefix(tiny_qwen):
    """Replaying a stored chain renders the committed tokens exactly, so the child reuses them all."""
    server = scripted_server(tiny_qwen, "Hello there.", device_state_slots=6, default_max_tokens=16)
    try:
        client = client_for(server)
        model = server.serving.model_id
        root = client.responses.create(model=model, input="Hi", reasoning={"effort": "none"},
                                       extra_body={"preserve_thinking": True})
        assert root.output_text == "Hello there." and root.status == "completed"
        child = client.responses.create(model=model, input="Again", previous_response_id=root.id,
                                        reasoning={"effort": "none"})
        assert child.previous_response_id == root.id
        # Everything the root computed (its prompt and all but the last output token) is reused.
        assert child.usage.input_tokens_details.cached_tokens >= root.usage.input_tokens + root.usage.output_tokens - 1
        # The stored chain shares one engine session; its checkpoints report private_response_replay.
        key = session_key_for(root.id)
        checkpoints = list(server.core.cache.checkpoints.values())
        replay = [ck for ck in checkpoints if ck.session_key == key]
        assert replay and any(ck.path == "private_response_replay" for ck in replay)
        newest = max(ck.checkpoint_id for ck in checkpoints)
        anonymous = client.responses.create(model=model, input="Once more", previous_response_id=child.id,
                                            reasoning={"effort": "none"}, store=False)
        assert anonymous.usage.input_tokens_details.cached_tokens >= child.usage.input_tokens
        new = [ck for ck in server.core.cache.checkpoints.values() if ck.checkpoint_id > newest]
        assert all(ck.session_key is None for ck in new)  # store:false reads the chain, never extends it
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(anonymous.id)
    finally:
        server.stop()


def test_scripted_reasoning_and_namespaced_function_calls(tools_server):
    client = client_for(tools_server)
    model = tools_server.serving.model_id
    kwargs = {"model": model, "input": "Weather and time in Paris?", "tools": [WEATHER, CLOCK]}
    resp = client.responses.create(**kwargs)
    assert resp.status == "completed"
    reasoning, message, weather, clock = resp.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "The user wants weather and time."
    assert reasoning.summary == []
    assert message.type == "message" and resp.output_text == "Checking both."
    assert (weather.name, weather.namespace) == ("get_weather", None)
    assert (clock.name, clock.namespace) == ("now", "mcp__clock")
    assert weather.id.startswith("fc_") and weather.call_id.startswith("call_") and weather.call_id != clock.call_id
    assert json.loads(weather.arguments) == {"city": "Paris", "days": 3}
    assert list(json.loads(weather.arguments)) == ["city", "days"]
    assert json.loads(clock.arguments) == {"zone": "CET"}
    assert resp.usage.output_tokens_details.reasoning_tokens > 0
    assert resp.tools[1].type == "namespace"

    # The same turn streamed: identical Items, calls announced after the message closes.
    _, events = stream_body(tools_server, {**kwargs, "stream": True})
    final = check_stream(events)
    assert [(i["type"], i.get("name"), i.get("namespace")) for i in final["output"]] == [
        ("reasoning", None, None), ("message", None, None), ("function_call", "get_weather", None),
        ("function_call", "now", "mcp__clock"),
    ]
    assert final["output"][3]["arguments"] == clock.arguments

    # The SDK's accumulating helper reconstructs the same final Response from the events.
    with client.responses.stream(**kwargs) as stream:
        helper = stream.get_final_response()
    assert [item.type for item in helper.output] == ["reasoning", "message", "function_call", "function_call"]
    assert helper.output[3].namespace == "mcp__clock"

    # Results in reverse order are matched by call_id and replayed in call order.
    results = [
        {"type": "function_call_output", "call_id": clock.call_id, "output": "12:00", "namespace": "mcp__clock",
         "name": "now"},
        {"type": "function_call_output", "call_id": weather.call_id, "output": "sunny"},
    ]
    follow = client.responses.create(model=model, previous_response_id=resp.id, input=results,
                                     tools=[WEATHER, CLOCK])
    assert follow.status == "completed"
    # The stored turn (reasoning, text, both calls) re-renders token for token: the whole parent is reused.
    assert follow.usage.input_tokens_details.cached_tokens >= resp.usage.input_tokens + resp.usage.output_tokens - 1
    listed = client.responses.input_items.list(follow.id, order="asc").data
    assert [item.call_id for item in listed] == [clock.call_id, weather.call_id]  # client order kept
    assert all(item.id.startswith("fco_") for item in listed)

    # allowed_tools narrows the callable set: the weather call stays text, so the region falls back.
    narrowed = client.responses.create(
        **kwargs,
        tool_choice={"type": "allowed_tools", "mode": "auto",
                     "tools": [{"type": "function", "name": "now", "namespace": "mcp__clock"}]},
    )
    assert [item.type for item in narrowed.output] == ["reasoning", "message"]
    assert "<function=get_weather>" in narrowed.output_text
    off = client.responses.create(**kwargs, tool_choice="none")
    assert [item.type for item in off.output] == ["reasoning", "message"] and "<tool_call>" in off.output_text


def test_input_tokens_match_create_and_store_replay(server):
    client = client_for(server)
    model = server.serving.model_id
    tools = [WEATHER, CLOCK]
    counted = client.responses.input_tokens.count(model=model, input="Count me.", instructions="Be terse.",
                                                  tools=tools)
    created = client.responses.create(model=model, input="Count me.", instructions="Be terse.", tools=tools,
                                      max_output_tokens=2)
    assert counted.object == "response.input_tokens" and counted.input_tokens == created.usage.input_tokens

    # Through previous_response_id the stored Items replay exactly like a client-sent full history,
    # and the parent's instructions do not carry forward.
    via_store = client.responses.input_tokens.count(model=model, previous_response_id=created.id,
                                                    input="Next.", tools=tools)
    history = [item.model_dump(exclude_none=True) for item in client.responses.input_items.list(created.id).data]
    history += [item.model_dump(exclude_none=True) for item in created.output]
    explicit = client.responses.input_tokens.count(model=model, input=[*history, {"role": "user", "content": "Next."}],
                                                   tools=tools)
    assert via_store.input_tokens == explicit.input_tokens
    child = client.responses.create(model=model, previous_response_id=created.id, input="Next.", tools=tools,
                                    max_output_tokens=1)
    assert child.usage.input_tokens == via_store.input_tokens and child.instructions is None


def test_retrieve_delete_and_descendants_keep_working(server):
    client = client_for(server)
    model = server.serving.model_id
    root = client.responses.create(model=model, input="Root turn.", max_output_tokens=2)
    child = client.responses.create(model=model, input="Child turn.", previous_response_id=root.id,
                                    max_output_tokens=2)
    assert client.responses.retrieve(root.id).id == root.id
    deleted = httpx.delete(f"{server.base_url}/v1/responses/{root.id}")
    assert deleted.json() == {"id": root.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(root.id)
    assert err.value.body["code"] == "response_not_found"
    assert httpx.delete(f"{server.base_url}/v1/responses/{root.id}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="x", previous_response_id=root.id)
    # The child keeps its own reconstructed history, so its chain continues after the root is gone.
    grandchild = client.responses.create(model=model, input="Grandchild turn.", previous_response_id=child.id,
                                         max_output_tokens=2)
    full = client.responses.input_tokens.count(model=model, previous_response_id=child.id, input="Grandchild turn.")
    assert grandchild.usage.input_tokens == full.input_tokens
    # Retrieval refuses stream recovery and include rather than ignoring them.
    for query in ("stream=true", "include=reasoning.encrypted_content", "starting_after=3"):
        bad = httpx.get(f"{server.base_url}/v1/responses/{child.id}?{query}")
        assert bad.status_code == 400, query


def test_preserve_thinking_is_inherited_and_input_may_be_omitted(server):
    client = client_for(server)
    model = server.serving.model_id
    root = client.responses.create(model=model, input="Think first.", max_output_tokens=4,
                                   extra_body={"preserve_thinking": True})
    assert root.output[0].type == "reasoning" and server.serving.response_store.get(root.id).preserve_thinking

    def count(**extra) -> int:
        return client.responses.input_tokens.count(model=model, input="Next.", previous_response_id=root.id,
                                                   **extra).input_tokens

    inherited = count()
    assert inherited == count(extra_body={"preserve_thinking": True})
    assert inherited > count(extra_body={"chat_template_kwargs": {"preserve_thinking": False}})  # reasoning dropped
    # The stored chain already holds a user query, so a continuation may send no new input.
    again = client.responses.create(model=model, previous_response_id=root.id, max_output_tokens=2)
    assert again.status == "incomplete" and client.responses.input_items.list(again.id).data == []


def test_store_false_is_neither_retrievable_nor_continuable(server):
    client = client_for(server)
    model = server.serving.model_id
    resp = client.responses.create(model=model, input="Ephemeral.", store=False, max_output_tokens=2)
    assert resp.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=model, input="x", previous_response_id=resp.id)
    assert err.value.body["param"] == "previous_response_id"


def test_input_items_pagination(server):
    client = client_for(server)
    items = [{"role": "user", "content": f"part {i}", "id": f"msg_client_{i}"} for i in range(5)]
    resp = client.responses.create(model=server.serving.model_id, input=items, max_output_tokens=1)
    ids = [item["id"] for item in items]
    page = httpx.get(f"{server.base_url}/v1/responses/{resp.id}/input_items?limit=2&order=asc").json()
    assert page["object"] == "list" and [i["id"] for i in page["data"]] == ids[:2]
    assert page["first_id"] == ids[0] and page["last_id"] == ids[1] and page["has_more"] is True
    for item in page["data"]:
        ITEM.validate_python(item)
        assert item["content"] == [{"type": "input_text", "text": item["content"][0]["text"]}]
    listed = [item.id for item in client.responses.input_items.list(resp.id, limit=2, order="asc")]  # auto-paginates
    assert listed == ids
    desc = httpx.get(f"{server.base_url}/v1/responses/{resp.id}/input_items?after={ids[3]}").json()
    assert [i["id"] for i in desc["data"]] == ids[2::-1] and desc["has_more"] is False  # desc is the default
    for query in ("limit=0", "limit=101", "order=up", "after=nope", "include=x"):
        assert httpx.get(f"{server.base_url}/v1/responses/{resp.id}/input_items?{query}").status_code == 400
    assert httpx.get(f"{server.base_url}/v1/responses/resp_missing/input_items").status_code == 404


def cancel_in_engine(server, request_id: str) -> None:
    """The engine cancels a running request while its client still listens."""
    server.serving.engine._send(Abort(request_id))


def running_request_id(server) -> str:
    wait_until(lambda: server.core.scheduler.running, what="a running request")
    return server.core.scheduler.running[0].request_id


def test_a_stream_the_engine_cancels_ends_cancelled(server):
    body = {"model": server.serving.model_id, "input": "Tell a long story.", "max_output_tokens": 400, "stream": True}
    events: list[tuple[str, dict]] = []
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=120) as resp:
        name = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
                if name.endswith(".delta") and sum(n.endswith(".delta") for n, _ in events) == 1:
                    cancel_in_engine(server, resp.headers["x-request-id"])  # at the first delta
        names = [n for n, _ in events]
    assert names[-1] == "response.cancelled" and "response.failed" not in names
    for event_name, payload in events[:-1]:
        assert event_name == payload["type"]
        STREAM_EVENT.validate_python(payload)
    final = events[-1][1]["response"]
    assert events[-1][1]["type"] == "response.cancelled" and final["status"] == "cancelled"
    validate_response(final)
    assert final["error"] is None and final["incomplete_details"] is None and final["completed_at"] is None
    item = final["output"][-1]  # the Item open when the engine cancelled
    assert item["status"] == "incomplete" and final["usage"]["output_tokens"] < 400
    stored = client_for(server).responses.retrieve(final["id"])
    assert stored.status == "cancelled" and stored.output[-1].id == item["id"]


def test_a_response_the_engine_cancels_ends_cancelled(server):
    client = client_for(server)
    result: dict = {}

    def create() -> None:
        result["response"] = client.responses.create(model=server.serving.model_id, input="Tell a long story.",
                                                     max_output_tokens=400)

    thread = threading.Thread(target=create)
    thread.start()
    cancel_in_engine(server, running_request_id(server))
    thread.join(60)
    response = result["response"]
    assert response.status == "cancelled" and response.error is None and response.usage.output_tokens < 400
    assert client.responses.retrieve(response.id).status == "cancelled"


def test_a_response_whose_client_went_away_is_not_stored(server):
    body = {"model": server.serving.model_id, "input": "Tell a long story.", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                response_id = json.loads(line[len("data: "):])["response"]["id"]
                break  # the client goes away after response.created
    wait_until(lambda: not server.core.scheduler.running, what="the request cancelled")
    with pytest.raises(openai.NotFoundError):
        client_for(server).responses.retrieve(response_id)


def test_cancel_and_compact_fail_explicitly(server):
    client = client_for(server)
    resp = client.responses.create(model=server.serving.model_id, input="x", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(resp.id)
    assert err.value.body["code"] == "background_not_supported"
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_missing")
    compacted = httpx.post(server.base_url + "/v1/responses/compact", json={"model": server.serving.model_id})
    assert compacted.status_code == 400 and compacted.json()["error"]["code"] == "compaction_not_supported"


@pytest.mark.slow
def test_store_bounds_lru_and_capacity(tiny_qwen):
    server = start_server(serve_config(tiny_qwen, response_store_max_records=2, default_max_tokens=2))
    try:
        client = client_for(server)
        model = server.serving.model_id
        first, second = (client.responses.create(model=model, input=f"turn {i}") for i in range(2))
        client.responses.retrieve(first.id)  # most recently used now
        third = client.responses.create(model=model, input="turn 2")
        store = server.serving.response_store
        assert len(store) == 2 and store.get(second.id) is None
        assert client.responses.retrieve(first.id).id == first.id and client.responses.retrieve(third.id)

        # A byte budget smaller than one Response: the prompt fits, the terminal record does not.
        assert store.get(third.id).size > 600
        store.max_bytes = 600
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=model, input="too big to keep")
        assert err.value.body["code"] == "response_store_capacity_exceeded"
        _, events = stream_body(server, {"model": model, "input": "too big to keep", "stream": True})
        final = check_stream(events)  # the stream had started: one response.failed terminal
        assert final["status"] == "failed" and "response_store_capacity_exceeded" in final["error"]["message"]
        assert store.get(final["id"]) is None
        assert client.responses.create(model=model, input="fine", store=False).status in ("completed", "incomplete")
        store.max_bytes = 10
        with pytest.raises(openai.BadRequestError) as err:  # known before generation: no tokens spent
            client.responses.create(model=model, input="x" * 50)
        assert err.value.body["code"] == "response_store_capacity_exceeded"
    finally:
        server.stop()


@pytest.mark.slow
def test_overloaded_server_answers_429(tiny_qwen):
    server = start_server(serve_config(tiny_qwen, max_concurrency=1, max_pending_requests=0, default_max_tokens=1))
    try:
        body = {"model": server.serving.model_id, "input": "Hi"}
        ticket = server.serving.engine.reserve()  # the only place: as if a request were in flight
        try:
            over = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30)
            assert over.status_code == 429 and over.json()["error"]["code"] == "server_overloaded"
            assert over.headers["x-request-id"]
            streamed = httpx.post(server.base_url + "/v1/responses", json={**body, "stream": True}, timeout=30)
            assert streamed.status_code == 429  # refused before any stream starts
        finally:
            ticket.release()
        assert httpx.post(server.base_url + "/v1/responses", json=body, timeout=30).status_code == 200
        assert httpx.post(server.base_url + "/v1/responses", json=body, timeout=30).status_code == 200  # released
    finally:
        server.stop()


@pytest.mark.slow
def test_effort_tiers_follow_the_template(tiny_qwen38):
    server = start_server(serve_config(tiny_qwen38, default_max_tokens=2))
    try:
        client = client_for(server)
        model = server.serving.model_id
        counts = {}
        for effort in ("none", "low", "medium", "xhigh"):
            counts[effort] = client.responses.input_tokens.count(model=model, input="Hi",
                                                                 reasoning={"effort": effort}).input_tokens
        assert counts["low"] != counts["medium"] and counts["xhigh"] != counts["medium"]
        resp = client.responses.create(model=model, input="Hi", reasoning={"effort": "low"})
        assert resp.reasoning.effort == "low" and resp.usage.input_tokens == counts["low"]
        for effort in ("minimal", "high", "max"):
            with pytest.raises(openai.BadRequestError) as err:
                client.responses.create(model=model, input="Hi", reasoning={"effort": effort})
            assert err.value.body["code"] == "reasoning_effort_not_supported"
            assert err.value.body["param"] == "reasoning.effort"
    finally:
        server.stop()
