"""Text or calls (tool_choice auto with a strict tool): free text without `<tool_call>`, then
optionally the calls, against the library's trigger construction it replaced (free text until
`<tool_call>`, which dispatches to the calls). Both must allow the same next bytes at every point
of texts with whole, partial and doubled markers, rendered calls after them, their corruptions and
random walks. Matched on a byte vocabulary (257 ids), so compiling takes milliseconds."""

from __future__ import annotations

import random

import pytest
import xgrammar

from ninfer.frontend.answer_format import AnswerFormat, ToolCalls, ToolSchema, canonical_json, tool_call
from ninfer.frontend.tool_call_parser import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from tests.frontend.test_answer_format import CALLS, NOOP, WEATHER, rendered_calls
from tests.frontend.test_shared_rules import EOS, WALKS, compiler, corruptions, random_walk, same_along  # noqa: F401

TEXTS = ["", "Sure.", "Let me check.\n\n", "<", "<tool_", "<tool_call", "x<tool_call\n", "<tool_cal>", "</tool_call>",
         "<<tool_", "a <tool_call> b", "<tool_call>", "<tool_call>\n", "<tool_call><tool_call>", "\n\n"]


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def trigger_form(tools: tuple[ToolSchema, ...], parallel: bool, thinking: bool) -> str:
    """The structural tag of the construction being replaced."""
    inners = [{"type": "sequence", "elements": tool_call(tool)["elements"][1:-1]} for tool in tools]
    inner = inners[0] if len(inners) == 1 else {"type": "or", "elements": inners}
    content = [_const("\n"), inner]
    if parallel:
        between = _const(f"{TOOL_CALL_CLOSE}\n{TOOL_CALL_OPEN}\n")
        content.append({"type": "star", "content": {"type": "sequence", "elements": [between, inner]}})
    answer = {
        "type": "triggered_tags",
        "triggers": [TOOL_CALL_OPEN],
        "tags": [{"type": "tag", "begin": TOOL_CALL_OPEN, "content": {"type": "sequence", "elements": content},
                  "end": TOOL_CALL_CLOSE}],
        "stop_after_first": True,
    }
    if thinking:
        answer = {"type": "sequence", "elements": [_const("\n\n"), answer]}
    return canonical_json({"type": "structural_tag", "format": answer})


def pair(compiler, tools: tuple[ToolSchema, ...], parallel: bool, thinking: bool = False) -> tuple:
    """(replaced, current) matchers of the same text-or-calls answer."""
    current = AnswerFormat(calls=ToolCalls(tools, required=False, parallel=parallel)).constraint(
        EOS if thinking else None)
    grammars = (compiler.compile_structural_tag(trigger_form(tools, parallel, thinking)),
                compiler.compile_grammar(current.grammar))
    return tuple(xgrammar.GrammarMatcher(grammar, override_stop_tokens=[EOS]) for grammar in grammars)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("thinking", [False, True])
def test_texts_calls_and_their_corruptions_match_the_trigger_form(compiler, parallel, thinking) -> None:
    rng = random.Random(2 * parallel + thinking)
    prefix = "\n\n" if thinking else ""
    calls = [rendered_calls(c) for c in CALLS] + [rendered_calls([("noop", {})])]
    texts = [prefix + text for text in TEXTS]
    texts += [prefix + text + call for text in TEXTS for call in calls]
    texts += [prefix + call + tail for call in calls for tail in ("\n", "x", "\n" + calls[0], TOOL_CALL_OPEN)]
    texts += [prefix + "a" + calls[0] + "b" + calls[1]]
    for text in texts:
        encoded = text.encode()
        same_along(pair(compiler, (WEATHER, NOOP), parallel, thinking), [*encoded, EOS])
        for corrupted in corruptions(encoded, rng, 3) if encoded else ():
            same_along(pair(compiler, (WEATHER, NOOP), parallel, thinking), [*corrupted, EOS])


@pytest.mark.parametrize("tools", [(WEATHER,), (WEATHER, NOOP)])
def test_random_walks_match_the_trigger_form(compiler, tools) -> None:
    rng = random.Random(len(tools))
    for parallel in (True, False):
        for _ in range(4 * WALKS):
            random_walk(pair(compiler, tools, parallel), rng)
            random_walk(pair(compiler, tools, parallel, thinking=True), rng)
