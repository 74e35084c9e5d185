"""Capability sets of the three template kinds the protocol parsers must handle (built directly)."""

from ninfer.frontend.capabilities import TemplateCapabilities

# Qwen3.5/3.6: thinking switch, no effort tiers, preserve_thinking supported (default off).
QWEN35 = TemplateCapabilities(
    supports_thinking_switch=True,
    thinking_default=True,
    effort_tiers=(),
    default_effort=None,
    supports_preserve_thinking=True,
    preserve_thinking_default=False,
    think_open="<think>",
    think_close="</think>",
)
# Qwen3.8: effort tiers low/medium/xhigh (default xhigh), preserve_thinking on by default.
QWEN38 = TemplateCapabilities(
    supports_thinking_switch=True,
    thinking_default=True,
    effort_tiers=("low", "medium", "xhigh"),
    default_effort="xhigh",
    supports_preserve_thinking=True,
    preserve_thinking_default=True,
    think_open="<think>",
    think_close="</think>",
)
# Plain ChatML (SmolLM2): no thinking, no tiers, no preserve_thinking.
CHATML = TemplateCapabilities(
    supports_thinking_switch=False,
    thinking_default=False,
    effort_tiers=(),
    default_effort=None,
    supports_preserve_thinking=False,
    preserve_thinking_default=False,
    think_open=None,
    think_close=None,
    supports_tools=False,
)
# A template that always opens a think block and has no switch (e.g. an R1-style template).
