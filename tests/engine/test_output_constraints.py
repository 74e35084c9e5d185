"""Output constraints and log probabilities through the real engine (scheduler + runner + sampler).

Random JSON schemas on a byte-level vocabulary (fast: the grammar compiles and masks 257 ids),
tool calls on the real 248K Qwen vocabulary, both decoded by a model that likes to close what it
opened (tests/preference_model.py) so every answer finishes; the thinking rule (the grammar
starts after the close token); log probabilities against the logits the sampler was handed;
decode overlap (rounds launched ahead) against synchronous rounds; `--spec mtp` against plain
decoding on a tiny random Qwen3.5 with an MTP head.
"""

from __future__ import annotations

import functools
import json
import random

import jsonschema
import pytest
import torch

from ninfer.artifact import open_artifact
from ninfer.assets.qwen_tokenizer import build_qwen3_5_tokenizer
from ninfer.config import EngineConfig
from ninfer.contract.constraint import OutputConstraint
from ninfer.contract.output import ErrorCode, FinishReason
from ninfer.contract.request import EngineRequest
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.frontend.answer_format import AnswerFormat, JsonAnswer, ToolCalls, ToolSchema
from ninfer.frontend.tokenizer import Tokenizer
from ninfer.frontend.tool_call_parser import ToolCallParser
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.preference_model import PreferenceLM, qwen_preferences
from tests.unit.conftest import make_byte_tokenizer

BYTE_EOS = 256
THINK_END = ord("~")  # the byte vocabulary's stand-in for </think>
CONFIG = dict(max_concurrency=8, max_context=1024, prefill_chunk=64, log_stats_interval_ms=0)


def run(core: EngineCore, requests: list[EngineRequest], max_steps: int = 20_000) -> dict:
    """request id -> (token ids, text, logprobs entries, final output)."""
    collected = {r.request_id: ([], [], []) for r in requests}
    finals = {}
    for request in requests:
        assert core.add_request(request) == []
    for _ in range(max_steps):
        if not core.has_work:
            break
        for out in core.step():
            tokens, texts, logprobs = collected[out.request_id]
            tokens.extend(out.new_token_ids)
            texts.append(out.text)
            logprobs.extend(out.logprobs or [])
            if out.finished:
                finals[out.request_id] = out
    return {rid: (tokens, "".join(texts), logprobs, finals[rid]) for rid, (tokens, texts, logprobs) in collected.items()}


@functools.cache
def byte_engine(thinker: bool = False, overlap: bool = False) -> EngineCore:
    """thinker: likes to close its thinking more than to end the turn; overlap: decode overlap on
    (rounds launched ahead, as on a GPU)."""
    tokenizer = make_byte_tokenizer()
    # 0xED leads the UTF-8 spelling of UTF-16 surrogates, which the library's character classes admit
    # but no text holds: a random byte model would write them, a trained one never does.
    liked = {ord('"'): 4.0, ord("}"): 4.0, ord("]"): 3.5, ord(","): 1.0, ord("1"): 1.0, BYTE_EOS: 4.0, 0xED: -30.0}
    if thinker:
        liked.update({THINK_END: 4.0, BYTE_EOS: 2.0})
    model = PreferenceLM(257, liked, {})
    return EngineCore(model, tokenizer, EngineConfig(**CONFIG, decode_overlap=overlap))


@functools.cache
def qwen_engine() -> EngineCore:
    tokenizer = Tokenizer(build_qwen3_5_tokenizer(), eos_token="<|im_end|>")
    liked, follows = qwen_preferences(tokenizer)
    model = PreferenceLM(248_320, liked, follows)
    return EngineCore(model, tokenizer, EngineConfig(**{**CONFIG, "max_concurrency": 6}))


def json_request(rid: str, schema: dict, seed: int, **kwargs) -> EngineRequest:
    constraint = AnswerFormat(json=JsonAnswer(schema, "response_format")).constraint(kwargs.pop("think_end", None))
    return EngineRequest(
        rid, list(b"Answer in JSON: "), SamplingParams(temperature=1.0, seed=seed), max_new_tokens=kwargs.pop("max_new", 400),
        stop_token_ids=[BYTE_EOS], constraint=constraint, **kwargs,
    )


# ---- random schemas --------------------------------------------------------------------------------


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const"]
    if depth < 2:
        kinds += ["object", "object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "object":
        names = rng.sample(["id", "name", "tags", "size", "ok", "kind", "note", "items"], rng.randint(1, 4))
        properties = {name: random_schema(rng, depth + 1) for name in names}
        required = [name for name in names if rng.random() < 0.7]
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low, "maxItems": low + rng.randint(0, 2)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1), random_schema(rng, depth + 1)]}
    if kind == "string":
        schema: dict = {"type": "string"}
        extra = rng.choice(["", "length", "pattern", "enum", "format"])
        if extra == "length":
            schema.update(minLength=rng.randint(0, 2), maxLength=rng.randint(2, 6))
        elif extra == "pattern":
            schema["pattern"] = rng.choice(["^[a-z]{1,4}$", "^[0-9]+-[A-Z]$", "^(yes|no)$"])
        elif extra == "enum":
            schema["enum"] = rng.sample(["red", "green", "blue", "a b", ""], 3)
        elif extra == "format":
            schema["format"] = rng.choice(["date", "email", "uuid"])
        return schema
    if kind == "integer":
        schema = {"type": "integer"}
        if rng.random() < 0.5:
            low = rng.randint(-50, 50)
            schema.update(minimum=low, maximum=low + rng.randint(0, 100))
        return schema
    if kind == "number":
        return {"type": "number", **({"minimum": 0} if rng.random() < 0.3 else {})}
    if kind == "enum":
        return {"enum": rng.sample([1, "x", None, True, 2.5, "long value"], 3)}
    if kind == "const":
        return {"const": rng.choice([7, "fixed", False, [1, 2], {"k": "v"}])}
    return {"type": kind}


def test_random_json_schemas_produce_outputs_that_validate() -> None:
    rng = random.Random(40)
    schemas = [random_schema(rng, depth=rng.choice([0, 1])) for _ in range(200)]
    requests = [json_request(f"s{i}", schema, seed=i) for i, schema in enumerate(schemas)]
    results = run(byte_engine(), requests)
    checker = jsonschema.FormatChecker()
    for i, schema in enumerate(schemas):
        _, text, _, final = results[f"s{i}"]
        assert final.finish_reason is FinishReason.STOP and final.stop_reason == BYTE_EOS, (schema, text)
        jsonschema.validate(json.loads(text), schema, format_checker=checker)


def test_constrained_rounds_run_ahead_and_decode_as_synchronous_rounds(monkeypatch) -> None:
    """Decode overlap with output constraints: each round is launched before the previous one is
    read, its masks given once that one is committed; the tokens equal synchronous rounds'."""
    rng = random.Random(41)
    schemas = [random_schema(rng, depth=1) for _ in range(24)]
    requests = [json_request(f"o{i}", schema, seed=500 + i) for i, schema in enumerate(schemas)]
    overlapped = byte_engine(overlap=True)
    deferred_rows = []
    sample_deferred = overlapped.runner.sample_deferred
    monkeypatch.setattr(overlapped.runner, "sample_deferred", lambda deferred, masks: (
        deferred_rows.extend(masks.values()), sample_deferred(deferred, masks))[1])
    ahead = run(overlapped, requests)
    synchronous = run(byte_engine(), requests)
    for request, schema in zip(requests, schemas):
        tokens, text, _, final = ahead[request.request_id]
        assert tokens == synchronous[request.request_id][0]
        assert final.finish_reason is FinishReason.STOP, text
        jsonschema.validate(json.loads(text), schema)
    # How many rounds ran ahead in the batch depends on when each grammar finished compiling on
    # the worker thread (admissions stop the overlap); alone, a request's rounds always do.
    # A request alone: every round after the first decode round is launched ahead (its first
    # token comes from the prefill, its second from the first round, which nothing preceded).
    for request in requests[:6]:
        deferred_rows.clear()
        (tokens, *_), = run(overlapped, [request]).values()
        assert tokens == synchronous[request.request_id][0]
        assert len(deferred_rows) >= len(tokens) - 2, (len(deferred_rows), len(tokens))
        # Masked, but for a round launched after the end-of-turn token (its draw is dropped).
        assert all(mask is not None for mask in deferred_rows[:-1])


def test_the_grammar_starts_after_the_thinking_close_token(monkeypatch) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    requests = [json_request(f"t{i}", schema, seed=100 + i, think_end=THINK_END) for i in range(6)]
    reasonings = []
    results = run(byte_engine(thinker=True), requests)
    # Alone (so its rounds run ahead), each request's rounds are sampled once the previous token is
    # committed: unmasked while it thinks, masked from the round after the close token on.
    overlapped = byte_engine(thinker=True, overlap=True)
    sample_deferred = overlapped.runner.sample_deferred
    masked_rows = []
    monkeypatch.setattr(overlapped.runner, "sample_deferred", lambda deferred, masks: (
        masked_rows.extend(mask is not None for mask in masks.values()), sample_deferred(deferred, masks))[1])
    for request in requests:
        (tokens, *_), = run(overlapped, [request]).values()
        assert tokens == results[request.request_id][0]
    assert any(masked_rows) and not all(masked_rows)
    for rid, (tokens, text, _, final) in results.items():
        assert final.finish_reason is FinishReason.STOP, text
        if THINK_END not in tokens:
            continue  # ended while thinking: nothing was constrained
        reasoning, answer = text.split("~", 1)
        reasonings.append(reasoning)
        assert answer.startswith("\n\n")
        assert set(json.loads(answer)) == {"n"}
    assert len(reasonings) >= 3
    # Reasoning is free: it writes what no JSON answer could start with.
    assert any(reasoning and reasoning.lstrip()[:1] not in ("{", "") for reasoning in reasonings)


def test_a_grammar_is_compiled_once_and_an_uncompilable_one_ends_its_request() -> None:
    core = byte_engine()
    schema = {"type": "object", "properties": {"only": {"type": "boolean"}}, "required": ["only"], "additionalProperties": False}
    first, second = json_request("c1", schema, 1), json_request("c2", schema, 2)
    assert first.constraint.key == second.constraint.key
    results = run(core, [first, second])
    assert core.grammars.get(first.constraint) is not None
    assert list(core.grammars.compile_seconds).count(first.constraint.key) == 1
    for _, text, _, final in results.values():
        assert json.loads(text) in ({"only": True}, {"only": False})
    broken = EngineRequest("bad", [1, 2, 3], max_new_tokens=5, constraint=OutputConstraint("k" * 64, "{not json"))
    (_, _, _, final), = run(core, [broken]).values()
    assert final.finish_reason is FinishReason.ERROR and final.error.code is ErrorCode.INVALID_REQUEST
    assert core.pool_accounting()["waiting"] == 0


def test_logprobs_are_the_log_softmax_of_the_logits_the_sampler_was_handed(monkeypatch) -> None:
    core = byte_engine()
    seen: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
    sample = core.runner.sampler.sample

    def recording(logits, batch):
        ids = sample(logits, batch)
        seen.append((logits.clone(), None if batch.token_bitmask is None else batch.token_bitmask.clone(), ids))
        return ids

    monkeypatch.setattr(core.runner.sampler, "sample", recording)
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
    constrained = json_request("lp", schema, 3, top_logprobs=5)
    (tokens, _, logprobs, final), = run(core, [constrained]).values()
    assert len(logprobs) == len(tokens) == len(seen)
    for (logits, mask, ids), entry, token in zip(seen, logprobs, tokens):
        assert ids.tolist() == [token]
        masked = core.runner.sampler.apply_token_bitmask(logits, mask) if mask is not None else logits
        reference = torch.log_softmax(masked[0].double(), dim=-1)
        assert entry.logprob == pytest.approx(float(reference[token]), abs=1e-5)
        allowed = int((reference > float("-inf")).sum())
        values, ids_top = torch.topk(reference, min(5, allowed))
        assert entry.top_logprobs == pytest.approx(values.tolist(), abs=1e-5)
        assert entry.top_token_ids[0] == int(ids_top[0]) and len(entry.top_token_ids) == min(5, allowed)
        assert all(reference[i] > float("-inf") for i in entry.top_token_ids)
    # Without a constraint every token keeps its mass; zero alternatives lists none.
    plain = EngineRequest("lp0", [5, 6, 7], SamplingParams(temperature=0.0), max_new_tokens=4,
                          stop_token_ids=[BYTE_EOS], top_logprobs=0)
    (tokens, _, logprobs, _), = run(core, [plain]).values()
    assert [entry.top_token_ids for entry in logprobs] == [[]] * len(tokens)
    assert all(entry.logprob <= 0 for entry in logprobs)


# ---- tool calls on the Qwen vocabulary ---------------------------------------------------------------


def random_tool(rng: random.Random, index: int) -> ToolSchema:
    pool = {
        "path": {"type": "string"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "mode": {"type": "string", "enum": ["fast", "safe", "dry run"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "label": {"type": "string", "maxLength": 5},
        "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "options": {"type": "object", "properties": {"deep": {"type": "boolean"}}, "required": ["deep"],
                    "additionalProperties": False},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
        "anything": {},
        "ratio": {"type": ["number", "string"]},
    }
    names = rng.sample(list(pool), rng.randint(0, 4))
    schema = {"type": "object", "properties": {n: pool[n] for n in names},
              "required": [n for n in names if rng.random() < 0.6], "additionalProperties": False}
    return ToolSchema(f"tool_{index}", schema, f"tools[{index}].function.parameters")


@pytest.mark.parametrize("required", [True, False])
def test_constrained_tool_calls_always_parse_and_validate(required: bool) -> None:
    core = qwen_engine()
    tokenizer = core.tokenizer
    rng = random.Random(41 + required)
    requests, tool_sets = [], {}
    for i in range(4):
        tools = tuple(random_tool(rng, j) for j in range(rng.randint(1, 3)))
        constraint = AnswerFormat(calls=ToolCalls(tools, required=required, parallel=rng.random() < 0.5)).constraint(None)
        rid = f"call{i}"
        tool_sets[rid] = tools
        requests.append(EngineRequest(
            rid, tokenizer.encode("Use a tool."), SamplingParams(temperature=1.0, seed=i), max_new_tokens=240,
            stop_token_ids=[tokenizer.token_to_id("<|im_end|>")], constraint=constraint,
        ))
    num_calls = 0
    for rid, (_, text, _, final) in run(core, requests).items():
        assert final.finish_reason is FinishReason.STOP, text
        schemas = {tool.name: tool.parameters for tool in tool_sets[rid]}
        start = text.find("<tool_call>")
        if required:
            assert start == 0, text
        if start < 0:
            continue
        parsed = ToolCallParser(schemas).parse(text[start:])
        assert parsed.structured, (text, parsed.fallback_reason)
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            num_calls += 1
    assert num_calls >= (4 if required else 1)


# ---- against plain decoding on a real tiny model -------------------------------------------------


@functools.cache
def tiny(root: str):
    artifact = open_artifact(str(make_tiny_qwen3_5(root, mtp=True, dtype="float32")))
    return artifact, artifact.load_model(dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("constraint-artifacts"))


def tiny_requests(tokenizer) -> list[EngineRequest]:
    end = tokenizer.token_to_id("<|im_end|>")
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}, "required": ["a"]}
    constraint = AnswerFormat(json=JsonAnswer(schema, "response_format")).constraint(None)
    greedy = SamplingParams(temperature=0.0)
    return [
        EngineRequest("json", list(range(1000, 1030)), greedy, max_new_tokens=16, stop_token_ids=[end],
                      constraint=constraint, top_logprobs=2),
        EngineRequest("free", list(range(2000, 2030)), greedy, max_new_tokens=16, stop_token_ids=[end]),
        EngineRequest("sampled", list(range(3000, 3030)), SamplingParams(temperature=1.0, seed=5), max_new_tokens=10,
                      stop_token_ids=[end], constraint=constraint),
    ]


def test_mtp_speculation_leaves_constrained_output_unchanged(root) -> None:
    artifact, model = tiny(root)
    config = dict(max_concurrency=3, max_context=512, prefill_chunk=32, log_stats_interval_ms=0)
    plain = run(EngineCore(model, artifact.tokenizer, EngineConfig(**config)), tiny_requests(artifact.tokenizer))
    spec_core = EngineCore(model, artifact.tokenizer, EngineConfig(**config, spec="mtp", draft_tokens=3, adaptive_drafts=False))
    spec = run(spec_core, tiny_requests(artifact.tokenizer))
    for rid in ("json", "free", "sampled"):
        assert spec[rid][0] == plain[rid][0], rid
    assert [e.logprob for e in spec["json"][2]] == pytest.approx([e.logprob for e in plain["json"][2]], abs=1e-4)
    # The constrained rows rode plainly beside a request that verified drafts.
    assert spec["free"][3].speculative.rounds > 0
    assert spec["json"][3].speculative.rounds == 0
    assert plain["json"][1].startswith("{")  # under the grammar from the first token
