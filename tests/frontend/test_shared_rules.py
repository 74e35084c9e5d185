"""shared_rules against the reference: the structural tag AnswerFormat writes, compiled as the
library converts it, and the merged EBNF the engine compiles must allow the same next bytes at
every point of every text tried (rendered tool calls, their corruptions, random walks through
grammars of random schemas), so they accept and reject exactly the same strings there. Matched
on a byte vocabulary (257 ids), so compiling takes milliseconds."""

from __future__ import annotations

import random

import numpy as np
import pytest
import xgrammar

from ninfer.frontend.answer_format import AnswerFormat, JsonAnswer, ToolCalls, ToolSchema, canonical_json
from ninfer.frontend.grammar_vocabulary import GrammarVocabulary
from ninfer.frontend.shared_rules import shared_rules
from tests.engine.test_output_constraints import random_schema
from tests.frontend.test_answer_format import CALLS, NOOP, WEATHER, rendered_calls
from tests.unit.conftest import make_byte_tokenizer

EOS = 256
VOCAB = 257
WALKS = 3  # random walks per grammar
WALK_STEPS = 160  # bytes per walk at most
STRUCTURE = frozenset(b'<>/=\n"{}[],:-.0123456789tfnTF')  # bytes that move a walk out of free text


@pytest.fixture(scope="module")
def compiler() -> xgrammar.GrammarCompiler:
    return xgrammar.GrammarCompiler(GrammarVocabulary(make_byte_tokenizer(), VOCAB).info, max_threads=1)


def matchers(compiler, answer: AnswerFormat, thinking: bool = False) -> tuple:
    """(reference, merged) matchers of the same answer format."""
    reference = compiler.compile_structural_tag(canonical_json(answer.structural_tag(thinking)))
    merged = compiler.compile_grammar(answer.constraint(EOS if thinking else None).grammar)
    return tuple(xgrammar.GrammarMatcher(grammar, override_stop_tokens=[EOS]) for grammar in (reference, merged))


def allowed(matcher) -> np.ndarray:
    mask = np.zeros(-(-VOCAB // 32), dtype=np.int32)
    matcher.fill_next_token_bitmask(mask)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB]
    return np.flatnonzero(bits)


def same_along(pair: tuple, tokens: list[int]) -> bool:
    """Both allow the same tokens before each of `tokens`; True when every token was accepted."""
    reference, merged = pair
    for token in tokens:
        assert np.array_equal(allowed(reference), allowed(merged))
        accepted = reference.accept_token(token)
        assert merged.accept_token(token) == accepted
        if not accepted:
            return False
    assert reference.is_terminated() == merged.is_terminated()
    return True


def random_walk(pair: tuple, rng: random.Random) -> None:
    reference, merged = pair
    for _ in range(WALK_STEPS):
        choices = allowed(reference)
        assert np.array_equal(choices, allowed(merged))
        if len(choices) == 0 or reference.is_terminated():
            return
        structural = [int(c) for c in choices if c in STRUCTURE or c == EOS]
        token = rng.choice(structural) if structural and rng.random() < 0.7 else int(rng.choice(choices))
        assert reference.accept_token(token) and merged.accept_token(token)
        if token == EOS:
            assert reference.is_terminated() and merged.is_terminated()
            return


def corruptions(text: bytes, rng: random.Random, count: int) -> list[bytes]:
    """The text cut short, with a byte replaced, inserted or removed."""
    out = []
    for _ in range(count):
        at = rng.randrange(len(text))
        byte = bytes([rng.choice(b'<>/\n"x1 ')])
        out += [text[:at], text[:at] + byte + text[at + 1:], text[:at] + byte + text[at:], text[:at] + text[at + 1:]]
    return out


@pytest.mark.parametrize("required", [True, False])
def test_rendered_calls_and_their_corruptions_match_the_reference(compiler, required) -> None:
    rng = random.Random(7)
    answer = AnswerFormat(calls=ToolCalls((WEATHER, NOOP), required=required))
    for calls in CALLS:
        text = rendered_calls(calls).encode()
        assert same_along(matchers(compiler, answer), [*text, EOS])
        for corrupted in corruptions(text, rng, 12):
            same_along(matchers(compiler, answer), [*corrupted, EOS])


def test_random_schemas_as_answers_and_as_tools_match_the_reference(compiler) -> None:
    rng = random.Random(40)
    schemas = [random_schema(rng, depth=rng.choice([0, 1])) for _ in range(200)]
    for i, schema in enumerate(schemas):
        for _ in range(WALKS):
            random_walk(matchers(compiler, AnswerFormat(json=JsonAnswer(schema, "response_format"))), rng)
    # Five tools of four parameters each: the merged grammar shares rules across all of them.
    for start in range(0, len(schemas), 20):
        tools = tuple(
            ToolSchema(f"tool_{start + t}", {
                "type": "object",
                "properties": {f"p{k}": schemas[start + 4 * t + k] for k in range(4)},
                "required": ["p0", "p2"],
            }, f"tools[{t}].function.parameters")
            for t in range(5)
        )
        for required in (True, False):
            answer = AnswerFormat(calls=ToolCalls(tools, required=required))
            for _ in range(WALKS):
                random_walk(matchers(compiler, answer), rng)
                random_walk(matchers(compiler, answer, thinking=True), rng)


def test_equal_rules_merge_and_distinct_ones_stay() -> None:
    ebnf = (
        'root ::= (("[" a "," b "," c "]"))\n'
        'a ::= (("x" a) | ("y")) (=("," d))\n'
        'b ::= (("x" b) | ("y")) (=("," d))\n'
        'c ::= (("x" c) | ("z"))\n'
        'd ::= (("q"))\n'
    )
    merged = shared_rules(ebnf)
    assert "b ::=" not in merged and 'root ::= (("[" a "," a "," c "]"))' in merged and "c ::=" in merged
    assert xgrammar.Grammar.from_ebnf(merged)


def test_an_exclusion_containing_another_is_dropped_and_keyword_arguments_are_not_rules() -> None:
    ebnf = (
        'root ::= (("<p>\\n" excludes "\\n</p>\\n"))\n'
        "excludes ::= TagDispatch(\n"
        "  loop_after_dispatch=false,\n"
        '  excludes=("<p=", "</p>", "\\n</p>\\n")\n'
        ")\n"
        'loop_after_dispatch ::= (("unused"))\n'
    )
    merged = shared_rules(ebnf)
    assert 'excludes=("<p=", "</p>")' in merged and "loop_after_dispatch=false" in merged
    assert xgrammar.Grammar.from_ebnf(merged)
