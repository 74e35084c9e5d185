"""Thinking, effort and preserve_thinking checked once against the loaded template's capabilities.

The three protocols spell these differently (Chat: reasoning_effort, enable_thinking and
chat_template_kwargs; Responses: reasoning.effort; Messages: thinking and output_config.effort)
and each parser reads its own spelling, but the rules of what the template can render live here.

Two policies for an effort the template does not expose:
- exact (OpenAI endpoints): HTTP 400 reasoning_effort_not_supported;
- nearest (Anthropic output_config.effort, which Claude Code sends on every request): the
  nearest tier the template exposes (ties go to the higher tier), plain thinking on a template
  with a thinking switch but no tiers, and no thinking on a template that cannot think. Each
  such mapping is reported in the server log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer.frontend.capabilities import EFFORT_TIERS, TemplateCapabilities
from ninfer.server.errors import APIError
from ninfer.server.validation.fields import cannot_provide, optional_bool


@dataclass
class ThinkingChoice:
    """What the prompt builder receives: None means the server/template default."""

    enable_thinking: bool | None = None
    template_effort: str | None = None  # a tier the template exposes
    preserve_thinking: bool | None = None
    requested_effort: str | None = None  # the client's value, for logs
    notes: list[str] = field(default_factory=list)  # compatibility mappings applied, for the log


def thinking_reachable(caps: TemplateCapabilities, enable: bool) -> bool:
    """Whether the template can render a new turn with thinking on (or off) at all."""
    if caps.supports_thinking_switch or caps.thinking_default == enable:
        return True
    if enable:
        return any(tier != "none" for tier in caps.effort_tiers)
    return "none" in caps.effort_tiers


def effort_not_supported(param: str, effort: str, caps: TemplateCapabilities) -> APIError:
    exposed = ", ".join(("none", *(t for t in caps.effort_tiers if t != "none")))
    return APIError(
        400,
        f"{param} {effort!r} is not exposed by the loaded chat template (supported: {exposed})",
        code="reasoning_effort_not_supported",
        param=param,
    )


def exact_effort(param: str, effort: str, caps: TemplateCapabilities) -> tuple[bool, str | None]:
    """An OpenAI effort: (enable thinking, the tier passed to the template) or reasoning_effort_not_supported."""
    enable = effort != "none"
    if (enable and effort not in caps.effort_tiers) or not thinking_reachable(caps, enable):
        raise effort_not_supported(param, effort, caps)
    # "none" reaches the template only when it is one of the template's own tiers.
    return enable, effort if enable or "none" in caps.effort_tiers else None


def nearest_effort(param: str, effort: str, caps: TemplateCapabilities, notes: list[str]) -> str | None:
    """The tier to render for an effort the client asked for (see the module docstring): the
    effort itself, the template's nearest tier, or None (no tiers); each mapping adds a note."""
    tiers = [tier for tier in caps.effort_tiers if tier != "none"]
    if effort in tiers:
        return effort
    if tiers:
        rank = EFFORT_TIERS.index(effort)
        served = min(tiers, key=lambda tier: (abs(EFFORT_TIERS.index(tier) - rank), -EFFORT_TIERS.index(tier)))
        notes.append(f"{param} {effort!r} served as {served!r}, the template's nearest tier")
        return served
    if thinking_reachable(caps, True):
        notes.append(f"{param} {effort!r} served as plain thinking (the template has no effort tiers)")
    else:
        notes.append(f"{param} {effort!r} ignored (the template cannot think)")
    return None


def template_option(body: dict, kwargs: dict, name: str) -> tuple[bool | None, str | None]:
    """A boolean given at top level or in chat_template_kwargs: (value, the spelling that gave it).
    Both spellings must agree."""
    top = optional_bool(body, name, name)
    nested = optional_bool(kwargs, name, f"chat_template_kwargs.{name}")
    if top is not None and nested is not None and top != nested:
        raise APIError(
            400,
            f"{name} ({str(top).lower()}) and chat_template_kwargs.{name} ({str(nested).lower()}) disagree",
            code="conflicting_template_option",
            param=name,
        )
    if top is not None:
        return top, name
    if nested is not None:
        return nested, f"chat_template_kwargs.{name}"
    return None, None


def check_template_kwargs(kwargs: dict, allowed: tuple[str, ...]) -> None:
    for key, value in kwargs.items():
        if key not in allowed and value is not None:
            raise cannot_provide(f"chat_template_kwargs.{key}", "arbitrary chat template variables")


def check_preserve_thinking(value: bool | None, param: str | None, caps: TemplateCapabilities) -> bool | None:
    if value and not caps.supports_preserve_thinking:
        raise cannot_provide(
            param or "preserve_thinking",
            "preserving closed-turn reasoning (the loaded chat template has no preserve_thinking switch)",
        )
    return value


def check_thinking_switch(enable: bool, param: str, caps: TemplateCapabilities) -> None:
    if not thinking_reachable(caps, enable):
        state = "enabling" if enable else "disabling"
        raise cannot_provide(param, f"{state} thinking (the loaded chat template has no thinking switch)")
