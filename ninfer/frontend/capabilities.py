"""TemplateCapabilities: what the loaded chat template can do, found by rendering it.

Capabilities come from the artifact's own chat template, never from the model name (a user
chooses the name), so start-up renders a few probe conversations and compares the prompts:

- thinking switch: `enable_thinking` true and false both render and give different prompts;
- thinking default: the default generation prompt leaves a think block open;
- effort tiers: a tier is exposed when it renders without the template raising and the
  template reacts to `reasoning_effort` at all (some tier's prompt differs from the prompt
  without it); the default tier is the one whose prompt equals the prompt without it;
- preserve_thinking: reasoning of a closed earlier assistant turn appears or not depending on
  the flag; its default is whether it appears when the flag is omitted;
- think markers: the tags around a rendered reasoning text (or in the generation prompt);
- tools: a declared tool's name and an assistant tool call's name both appear in the prompt.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ninfer.frontend.template import ChatTemplate, TemplateError

# OpenAI's reasoning_effort spellings, in increasing order of effort.
EFFORT_TIERS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

_PROBE_REASONING = "NINFER-PROBE-REASONING"
_PROBE_ANSWER = "NINFER-PROBE-ANSWER"
_PROBE_TOOL = "ninfer_probe_tool"
_TAG = re.compile(r"<[^<>\s]{1,64}>")


@dataclass(frozen=True)
class TemplateCapabilities:
    supports_thinking_switch: bool
    thinking_default: bool
    effort_tiers: tuple[str, ...]
    default_effort: str | None
    supports_preserve_thinking: bool
    preserve_thinking_default: bool
    think_open: str | None
    think_close: str | None
    supports_tools: bool = True

    @property
    def supports_thinking(self) -> bool:
        return self.think_open is not None and self.think_close is not None

    @classmethod
    def resolve(cls, template: ChatTemplate) -> TemplateCapabilities:
        """Probe `template`; raises TemplateError if it cannot render a plain chat at all."""
        probe = _Probe(template)
        baseline = probe.render(_plain_chat())
        if baseline is None:
            template.render(_plain_chat())  # re-raise the template's own error for the caller
            raise TemplateError("chat template cannot render a plain conversation")

        think_open, think_close = probe.think_markers()

        thinking_on = probe.render(_plain_chat(), enable_thinking=True)
        thinking_off = probe.render(_plain_chat(), enable_thinking=False)
        switch = thinking_on is not None and thinking_off is not None and thinking_on != thinking_off

        tiers, default_effort = probe.effort_tiers(baseline)

        preserved_on = probe.render(_closed_reasoning_chat(), preserve_thinking=True)
        preserved_off = probe.render(_closed_reasoning_chat(), preserve_thinking=False)
        preserved_default = probe.render(_closed_reasoning_chat())
        supports_preserve = (
            preserved_on is not None
            and preserved_off is not None
            and preserved_on != preserved_off
            and _PROBE_REASONING in preserved_on
        )

        return cls(
            supports_thinking_switch=switch,
            thinking_default=probe.opens_thinking(think_open, think_close),
            effort_tiers=tiers,
            default_effort=default_effort,
            supports_preserve_thinking=supports_preserve,
            preserve_thinking_default=supports_preserve and preserved_default == preserved_on,
            think_open=think_open,
            think_close=think_close,
            supports_tools=probe.renders_tools(),
        )


class _Probe:
    def __init__(self, template: ChatTemplate):
        self.template = template

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str | None:
        """The prompt, or None when the template rejects this input."""
        try:
            return self.template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        except TemplateError:
            return None

    def generation_prompt(self, **kwargs: Any) -> str | None:
        with_prompt = self.render(_plain_chat(), **kwargs)
        without_prompt = self.render(_plain_chat(), add_generation_prompt=False, **kwargs)
        if with_prompt is None or without_prompt is None or not with_prompt.startswith(without_prompt):
            return None
        return with_prompt[len(without_prompt) :]

    def think_markers(self) -> tuple[str | None, str | None]:
        """Tags that wrap reasoning in a rendered assistant turn after the last user query."""
        rendered = self.render(_open_reasoning_chat(), add_generation_prompt=False)
        if rendered is not None and _PROBE_REASONING in rendered:
            before, _, after = rendered.partition(_PROBE_REASONING)
            opens = _TAG.findall(before)
            closes = _TAG.findall(after)
            # Only whitespace may separate the reasoning from its tags.
            if opens and closes and before.rstrip().endswith(opens[-1]) and after.lstrip().startswith(closes[0]):
                return opens[-1], closes[0]
        # No reasoning rendered: fall back to a tag pair the generation prompts show.
        for kwargs in ({"enable_thinking": False}, {}):
            prompt = self.generation_prompt(**kwargs)
            tags = _TAG.findall(prompt or "")
            for first, second in itertools.pairwise(tags):
                if second == first[:1] + "/" + first[1:]:
                    return first, second
        return None, None

    def opens_thinking(self, think_open: str | None, think_close: str | None) -> bool:
        """Whether the default generation prompt ends inside an open think block."""
        if think_open is None or think_close is None:
            return False
        prompt = self.generation_prompt()
        if prompt is None or think_open not in prompt:
            return False
        return think_close not in prompt[prompt.rindex(think_open) :]

    def renders_tools(self) -> bool:
        tool = {"type": "function", "function": {"name": _PROBE_TOOL, "parameters": {"type": "object"}}}
        declared = self.render(_plain_chat(), tools=[tool])
        call = {"type": "function", "id": "call_0", "function": {"name": _PROBE_TOOL + "_called", "arguments": {}}}
        history = self.render(
            [
                {"role": "user", "content": "Hello."},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "ok"},
            ]
        )
        return declared is not None and _PROBE_TOOL in declared and history is not None and _PROBE_TOOL + "_called" in history

    def effort_tiers(self, baseline: str) -> tuple[tuple[str, ...], str | None]:
        rendered = {tier: self.render(_plain_chat(), reasoning_effort=tier) for tier in EFFORT_TIERS}
        accepted = {tier: text for tier, text in rendered.items() if text is not None}
        if not any(text != baseline for text in accepted.values()):
            return (), None  # the template ignores reasoning_effort
        defaults = [tier for tier, text in accepted.items() if text == baseline]
        return tuple(accepted), defaults[0] if len(defaults) == 1 else None


def _plain_chat() -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Hello."}]


def _open_reasoning_chat() -> list[dict[str, Any]]:
    """An assistant turn after the last user query: every thinking template renders its reasoning."""
    return [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": _PROBE_ANSWER, "reasoning_content": _PROBE_REASONING},
    ]


def _closed_reasoning_chat() -> list[dict[str, Any]]:
    """Reasoning in an assistant turn that a later user query closed."""
    return [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": _PROBE_ANSWER, "reasoning_content": _PROBE_REASONING},
        {"role": "user", "content": "And then?"},
    ]


def resolve_capabilities(source: str, special_tokens: Mapping[str, str] | None = None) -> TemplateCapabilities:
    """Capabilities of a template given as source text (special tokens as template variables)."""
    tokens = dict(special_tokens or {})
    template = ChatTemplate(
        source,
        bos_token=tokens.pop("bos_token", None),
        eos_token=tokens.pop("eos_token", None),
        pad_token=tokens.pop("pad_token", None),
        unk_token=tokens.pop("unk_token", None),
        extra_variables=tokens,
    )
    return TemplateCapabilities.resolve(template)
