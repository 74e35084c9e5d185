"""Bundled text assets: the Qwen3.5 tokenizer builder and our Qwen chat templates.

Templates (``templates/*.jinja``), written from the documented Qwen ChatML format:

- ``qwen3_5``: Qwen3.5 / 3.6 compatible. ChatML turns; a leading system message only;
  a ``# Tools`` block with one JSON schema per line and the XML calling instructions;
  assistant tool calls as ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>…``
  (mappings and lists as JSON, other values as ``|string``); consecutive tool results grouped
  into one user turn of ``<tool_response>`` blocks; reasoning from ``reasoning_content`` or
  from content split at ``</think>``, kept only after the last real user query unless
  ``preserve_thinking`` is true (the 3.6 extension, default off); generation prompt
  ``<think>\\n`` (thinking) or ``<think>\\n\\n</think>\\n\\n`` (``enable_thinking=false``);
  image and video parts as ``<|vision_start|><|image_pad|><|vision_end|>`` / ``<|video_pad|>``
  (optionally numbered with ``add_vision_id``).
- ``qwen3_8``: Qwen3.8 style. As above, but ``reasoning_effort`` selects low / medium /
  xhigh (default xhigh; anything else raises) and injects the tier's instruction at the
  top of the system turn when thinking is on; ``preserve_thinking`` defaults on; reasoning
  comes only from ``reasoning_content``; tool arguments are strings verbatim, all other
  values JSON.
"""

from __future__ import annotations

from importlib import resources

TEMPLATE_NAMES = ("qwen3_5", "qwen3_8")


def chat_template_source(name: str) -> str:
    """Jinja source of a bundled chat template ("qwen3_5" or "qwen3_8")."""
    if name not in TEMPLATE_NAMES:
        raise ValueError(f"unknown bundled chat template {name!r} (have: {', '.join(TEMPLATE_NAMES)})")
    return (resources.files(__name__) / "templates" / f"{name}.jinja").read_text(encoding="utf-8")
