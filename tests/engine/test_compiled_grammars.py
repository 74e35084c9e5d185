"""CompiledGrammars on the real 248K Qwen vocabulary: grammars compiled by a primed engine compiler
(the library's rule cache holding the primer's masks) admit, token by token, exactly what the
construction they replaced admits compiled on its own (the library's conversion of the structural
tag, its trigger form for text-or-calls answers, no rewriting, no cache): the same token mask at
every step of rendered calls of tools with every parameter type, of near misses, of byte
corruptions re-tokenized, and of random walks."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import xgrammar

from ninfer.assets.qwen_tokenizer import build_qwen3_5_tokenizer
from ninfer.engine.compiled_grammars import CompiledGrammars
from ninfer.frontend.answer_format import AnswerFormat, JsonAnswer, ToolCalls, ToolSchema, canonical_json
from ninfer.frontend.grammar_vocabulary import GrammarVocabulary
from ninfer.frontend.tokenizer import Tokenizer
from tests.frontend.test_answer_format import rendered_calls
from tests.frontend.test_free_text_before_calls import trigger_form
from tests.frontend.test_shared_rules import corruptions

VOCAB = 248_320
WALKS = 4  # random walks per grammar
WALK_STEPS = 60
S, I, B = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}


def obj(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


TOOLS = (
    ToolSchema("edit", obj({"file_path": S, "old_string": S, "new_string": S, "replace_all": B},
                           ["file_path", "old_string", "new_string"]), "tools[0].function.parameters"),
    ToolSchema("search", obj({
        "query": {**S, "minLength": 2}, "title": {**S, "maxLength": 8}, "code": {**S, "minLength": 3},
        "tag": {**S, "pattern": "^[a-z]+$"}, "mode": {**S, "enum": ["a", "b c"]}, "level": {"enum": [1, "x", None]},
        "limit": {**I, "minimum": 1, "maximum": 600000},
        "ratio": {"type": "number"}, "none": {"type": "null"}, "maybe": {"anyOf": [I, {"type": "null"}]}, "any": {},
        "domains": {"type": "array", "items": S, "maxItems": 4},
    }, ["query"]), "tools[1].function.parameters"),
    ToolSchema("todo", obj({"todos": {"type": "array", "items": obj({
        "content": {**S, "minLength": 1}, "status": {"enum": ["pending", "done"]}, "n": I,
        "meta": obj({"k": {**S, "minLength": 2}, "v": {"type": "number"}}, ["k"]),
    }, ["content", "status"])}}, ["todos"]), "tools[2].function.parameters"),
    ToolSchema("noop", None, "tools[3].function.parameters"),
)
CALLS = [
    [("edit", {"file_path": "/src/main.py", "old_string": "    return x\n",
               "new_string": "    return x + 1  # 日本語 <b>", "replace_all": True})],
    [("search", {"query": "grammar compile", "title": "short", "code": "abc", "tag": "abc", "mode": "b c", "level": 1,
                 "limit": 600000, "ratio": -1.5e3, "maybe": 5, "any": {"x": [1, "y"]}, "domains": ["a.com", "b.org"]})],
    [("todo", {"todos": [{"content": "write tests", "status": "pending", "n": 3, "meta": {"k": "é!", "v": 0.5}}]}),
     ("noop", {})],
]
NEAR_MISSES = [  # each breaks one rule of one parameter
    [("search", {"query": "g"})],
    [("search", {"query": "ok", "title": "nine chars"})],
    [("search", {"query": "ok", "code": "ab"})],
    [("search", {"query": "ok", "tag": "ABC"})],
    [("search", {"query": "ok", "limit": 600001})],
    [("search", {"query": "ok", "domains": ["a", "b", "c", "d", "e"]})],
    [("todo", {"todos": [{"content": "", "status": "pending"}]})],
    [("todo", {"todos": [{"content": "x", "status": "pending", "meta": {"k": "é"}}]})],
    [("edit", {"file_path": "a", "old_string": "b"})],
    [("edit", {"file_path": "a <parameter=x>", "old_string": "b", "new_string": "c"})],
]
JSON_ANSWER = obj({"title": {**S, "minLength": 1}, "year": {**I, "minimum": 1900, "maximum": 2100},
                   "genres": {"type": "array", "items": {**S, "minLength": 2}}, "rating": {"type": "number"}},
                  ["title", "year"])


@functools.cache
def qwen() -> tuple[Tokenizer, GrammarVocabulary, int]:
    tokenizer = Tokenizer(build_qwen3_5_tokenizer(), eos_token="<|im_end|>")
    return tokenizer, GrammarVocabulary(tokenizer, VOCAB), tokenizer.token_to_id("<|im_end|>")


@functools.cache
def engine_grammars() -> CompiledGrammars:
    return CompiledGrammars(qwen()[1])


@functools.cache
def bare_compiler() -> xgrammar.GrammarCompiler:
    return xgrammar.GrammarCompiler(qwen()[1].info, max_threads=1, cache_enabled=False)


def replaced_tag(answer: AnswerFormat) -> str:
    """The structural tag as the replaced construction wrote it."""
    calls = answer.calls
    if calls is not None and not calls.required and answer.json is None:
        return trigger_form(calls.tools, calls.parallel, thinking=False)
    return canonical_json(answer.structural_tag(thinking=False))


def matchers(answer: AnswerFormat) -> tuple:
    """(replaced, engine) matchers of the same answer."""
    end = qwen()[2]
    replaced = bare_compiler().compile_structural_tag(replaced_tag(answer))
    engine = engine_grammars().compile(answer.constraint(None)).result()
    return tuple(xgrammar.GrammarMatcher(grammar, override_stop_tokens=[end]) for grammar in (replaced, engine))


def allowed(matcher) -> np.ndarray:
    mask = np.zeros(-(-VOCAB // 32), dtype=np.int32)
    matcher.fill_next_token_bitmask(mask)
    return mask


def same_along(pair: tuple, tokens: list[int]) -> bool:
    """Both allow the same tokens before each of `tokens`; True when every token was accepted."""
    replaced, engine = pair
    for token in tokens:
        assert np.array_equal(allowed(replaced), allowed(engine))
        accepted = replaced.accept_token(token)
        assert engine.accept_token(token) == accepted
        if not accepted:
            return False
    assert replaced.is_terminated() == engine.is_terminated()
    return True


def random_walk(pair: tuple, rng: random.Random, familiar: list[int]) -> None:
    """Mostly tokens the rendered calls use (so walks get through the structure), else any allowed one."""
    replaced, engine = pair
    for _ in range(WALK_STEPS):
        mask = allowed(replaced)
        assert np.array_equal(mask, allowed(engine))
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB]
        choices = np.flatnonzero(bits)
        if len(choices) == 0 or replaced.is_terminated():
            return
        known = [t for t in familiar if bits[t]]
        token = rng.choice(known) if known and rng.random() < 0.7 else int(rng.choice(choices))
        assert replaced.accept_token(token) and engine.accept_token(token)
        if replaced.is_terminated():
            assert engine.is_terminated()
            return


@pytest.mark.parametrize("required", [True, False])
def test_tool_calls_match_the_replaced_grammar(required) -> None:
    tokenizer, _, end = qwen()
    answer = AnswerFormat(calls=ToolCalls(TOOLS, required=required))
    rng = random.Random(required)
    texts = [rendered_calls(calls) for calls in CALLS + NEAR_MISSES]
    if not required:
        texts += ["Let me look.\n\n" + texts[0], "x<tool_call" + texts[1], "No call is needed.", "<tool_call>"]
    familiar = sorted({t for text in texts for t in tokenizer.encode(text)})
    for text in texts:
        same_along(matchers(answer), [*tokenizer.encode(text), end])
    tokens = {id(calls): [*tokenizer.encode(rendered_calls(calls)), end] for calls in CALLS + NEAR_MISSES}
    assert all(same_along(matchers(answer), tokens[id(calls)]) for calls in CALLS)
    assert not any(same_along(matchers(answer), tokens[id(calls)]) for calls in NEAR_MISSES)
    for corrupted in (c for text in texts[:3] for c in corruptions(text.encode(), rng, 4)):
        same_along(matchers(answer), [*tokenizer.encode(corrupted.decode(errors="replace")), end])
    for _ in range(WALKS):
        random_walk(matchers(answer), rng, familiar)


def test_json_answers_match_the_replaced_grammar() -> None:
    tokenizer, _, end = qwen()
    answer = AnswerFormat(json=JsonAnswer(JSON_ANSWER, "response_format"))
    texts = ['{"title": "Dune", "year": 1965, "genres": ["sf", "épique"], "rating": 4.5}',
             '{"title": "", "year": 1965}', '{"title": "a\\"b", "year": 1965}',
             '{"title": "x", "year": 1965, "genres": ["s"]}', '{"title": "\t", "year": 2100}']
    familiar = sorted({t for text in texts for t in tokenizer.encode(text)})
    assert same_along(matchers(answer), [*tokenizer.encode(texts[0]), end])
    for text in texts[1:]:
        same_along(matchers(answer), [*tokenizer.encode(text), end])
    rng = random.Random(5)
    for _ in range(WALKS):
        random_walk(matchers(answer), rng, familiar)


def test_the_primer_is_compiled_once_per_engine() -> None:
    grammars = CompiledGrammars(qwen()[1])
    compiler = grammars._get_compiler()
    assert compiler.get_cache_size_bytes() > 0  # the primer's masks
    assert grammars._get_compiler() is compiler
    constraint = AnswerFormat(calls=ToolCalls(TOOLS[:1], required=True)).constraint(None)
    grammars.compile(constraint).result()
    assert grammars.get(constraint) is not None and list(grammars.compile_seconds) == [constraint.key]
    grammars.shutdown()
