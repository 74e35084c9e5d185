"""PromptBuilder: template rendering of a Conversation, token ids, and exact cache frontiers."""

from __future__ import annotations

import pytest

from ninfer.assets import chat_template_source
from ninfer.assets.qwen_tokenizer import build_qwen3_5_tokenizer, qwen3_5_tokenizer_config
from ninfer.contract.reuse_path import ReusePath
from ninfer.frontend.capabilities import TemplateCapabilities
from ninfer.frontend.conversation import Conversation, MediaPart, Message, TextPart, Tool, ToolCall
from ninfer.frontend.prompt_builder import PromptBuilder
from ninfer.frontend.template import ChatTemplate
from ninfer.frontend.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_qwen3_5_tokenizer(), **_special(qwen3_5_tokenizer_config()))


def _special(config: dict) -> dict:
    def content(value):
        return value.get("content") if isinstance(value, dict) else value

    return {"eos_token": content(config.get("eos_token")), "pad_token": content(config.get("pad_token"))}


def builder(tokenizer: Tokenizer, name: str = "qwen3_5", **kw) -> PromptBuilder:
    template = ChatTemplate.for_tokenizer(chat_template_source(name), tokenizer)
    return PromptBuilder(template, tokenizer, TemplateCapabilities.resolve(template), **kw)


def user(text: str, **kw) -> Message:
    return Message("user", [TextPart(text, **kw)])


def test_prompt_equals_template_render_tokenized(tokenizer):
    b = builder(tokenizer)
    conv = Conversation([Message("developer", [TextPart("Be brief.")]), user("Hi"), ])
    prepared = b.build(conv)
    expected = b.template.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True, enable_thinking=True, preserve_thinking=False,
    )
    assert prepared.token_ids == tokenizer.encode(expected)
    assert prepared.thinking and prepared.enable_thinking is True
    off = b.build(Conversation([user("Hi")], enable_thinking=False))
    assert not off.thinking and off.enable_thinking is False


def test_text_parts_join_without_separators(tokenizer):
    b = builder(tokenizer)
    joined = b.build(Conversation([Message("user", [TextPart("ab"), TextPart("cd")])]))
    single = b.build(Conversation([user("abcd")]))
    assert joined.token_ids == single.token_ids


def test_mid_conversation_system_keeps_its_position(tokenizer):
    b = builder(tokenizer)
    conv = Conversation([
        user("first"),
        Message("assistant", [TextPart("answer")]),
        Message("system", [TextPart("New rule: be formal.")]),
        user("second"),
    ])
    text = tokenizer.decode(b.build(conv).token_ids)
    assert "<|im_start|>assistant\nanswer<|im_end|>\n<|im_start|>system\nNew rule: be formal.<|im_end|>\n" \
           "<|im_start|>user\nsecond<|im_end|>" in text
    # the first request's turn-closure checkpoint stays a token prefix of the longer conversation
    earlier = b.build(Conversation([user("first")]))
    (closure,) = [h.frontier for h in earlier.capture_hints if h.path is ReusePath.PRIVATE_TURN_CLOSURE]
    assert b.build(conv).token_ids[:closure] == earlier.token_ids[:closure]


def test_turn_closure_frontier_is_an_exact_prefix(tokenizer):
    b = builder(tokenizer)
    history = [
        user("What is 2+2?"),
        Message("assistant", [TextPart("")], reasoning="Add them.",
                tool_calls=[ToolCall("calc", {"expr": "2+2"}, "call_1")]),
        Message("tool", [TextPart("4")], tool_call_id="call_1"),
    ]
    tools = [Tool("calc", "evaluate", {"type": "object", "properties": {"expr": {"type": "string"}}})]
    prepared = b.build(Conversation(history, tools=tools))
    (hint,) = [h for h in prepared.capture_hints if h.path is ReusePath.PRIVATE_TURN_CLOSURE]
    prefix = b.template.render(
        [{"role": "user", "content": "What is 2+2?"}],
        tools=[{"type": "function", "function": {"name": "calc", "description": "evaluate",
                                                  "parameters": tools[0].parameters}}],
        add_generation_prompt=False, enable_thinking=True, preserve_thinking=False,
    )
    assert hint.frontier == len(tokenizer.encode(prefix))  # before the open turn's first assistant opener
    assert prepared.token_ids[: hint.frontier] == tokenizer.encode(prefix)
    preserved = b.build(Conversation(history, tools=tools, preserve_thinking=True))
    (hint2,) = [h for h in preserved.capture_hints if h.path is ReusePath.PRIVATE_TURN_CLOSURE]
    assert hint2.frontier > hint.frontier  # just before the generation prologue instead


def test_cache_breakpoints_map_to_exact_frontiers(tokenizer):
    b = builder(tokenizer)
    system = Message("system", [TextPart("You are a careful assistant.", cache_breakpoint=True)])
    conv = Conversation([system, user("Hello there", cache_breakpoint=True)])
    prepared = b.build(conv)
    shared = [h.frontier for h in prepared.capture_hints if h.path is ReusePath.SHARED_STABLE_PREFIX]
    assert len(shared) == 2
    text = tokenizer.decode(prepared.token_ids)
    first = tokenizer.decode(prepared.token_ids[: shared[0]])
    assert first.endswith("You are a careful assistant.") and text.startswith(first)
    second = tokenizer.decode(prepared.token_ids[: shared[1]])
    assert second.endswith("Hello there")
    implicit = b.build(Conversation([user("Hello there")], implicit_cache_breakpoint=True))
    assert [h.frontier for h in implicit.capture_hints if h.path is ReusePath.SHARED_STABLE_PREFIX] == [shared[1] - len(
        tokenizer.encode("<|im_start|>system\nYou are a careful assistant.<|im_end|>\n"))]
    # a boundary the tokenizer merges across (a trailing space before the next word) is not representable
    split = Message("system", [TextPart("Be careful. ", cache_breakpoint=True), TextPart("Today is Monday.")])
    assert not [h for h in b.build(Conversation([split, user("x")])).capture_hints if h.path is ReusePath.SHARED_STABLE_PREFIX]


def test_a_breakpoint_on_an_image_part_ends_after_its_placeholder(tokenizer):
    image = MediaPart("image", "data:image/png;base64,AAAA", cache_breakpoint=True)
    prepared = builder(tokenizer).build(Conversation([Message("user", [image, TextPart("Describe it.")])]))
    (shared,) = [h.frontier for h in prepared.capture_hints if h.path is ReusePath.SHARED_STABLE_PREFIX]
    assert tokenizer.decode(prepared.token_ids[:shared]).endswith("<|vision_start|><|image_pad|><|vision_end|>")


def test_assistant_prefill_continues_the_message(tokenizer):
    b = builder(tokenizer)
    conv = Conversation([user("Count"), Message("assistant", [TextPart("One, two,")])], continue_final_message=True)
    prepared = b.build(conv)
    text = tokenizer.decode(prepared.token_ids)
    assert text.endswith("One, two,") and "<|im_end|>" not in text.split("<|im_start|>assistant")[-1]
    assert not prepared.thinking and prepared.capture_hints == []


def test_effort_tiers_reach_the_template(tokenizer):
    b = builder(tokenizer, "qwen3_8")
    low = tokenizer.decode(b.build(Conversation([user("hi")], reasoning_effort="low")).token_ids)
    default = tokenizer.decode(b.build(Conversation([user("hi")])).token_ids)
    assert "Reasoning effort is set to low" in low and "Reasoning effort is set to xhigh" in default


def _long_text(label: str, approx_tokens: int) -> str:
    return " ".join(f"{label} item {i} says something" for i in range(approx_tokens // 6))


def test_long_prompts_get_anchors_at_late_message_starts(tokenizer):
    b = builder(tokenizer)
    start = tokenizer.token_to_id("<|im_start|>")
    assert b.message_start_id == start
    messages = [Message("system", [TextPart(_long_text("system", 1500))])]
    for turn in range(3):
        messages += [user(_long_text(f"question {turn}", 1500)), Message("assistant", [TextPart("short answer")])]
    messages.append(user(_long_text("last question", 1500)))
    prepared = b.build(Conversation(messages))
    anchors = [h.frontier for h in prepared.capture_hints if h.path == ReusePath.PRIVATE_LONG_ANCHOR]
    assert len(prepared.token_ids) > 4096 and len(anchors) == 2
    assert all(prepared.token_ids[f] == start for f in anchors)  # each sits on a message start
    # The latest is the last user message's start: an edit of that message still reuses everything before it.
    edited = b.build(Conversation([*messages[:-1], user(_long_text("edited question", 1500))]))
    last_anchor = max(anchors)
    assert edited.token_ids[:last_anchor] == prepared.token_ids[:last_anchor]
    assert edited.token_ids[last_anchor + 3] != prepared.token_ids[last_anchor + 3]
    assert anchors[1] - anchors[0] >= 1024
    # Short prompts, and a builder configured without anchors, get none.
    short = b.build(Conversation([user("hi")]))
    assert not [h for h in short.capture_hints if h.path == ReusePath.PRIVATE_LONG_ANCHOR]
    none = builder(tokenizer, max_long_anchors=0).build(Conversation(messages))
    assert not [h for h in none.capture_hints if h.path == ReusePath.PRIVATE_LONG_ANCHOR]
