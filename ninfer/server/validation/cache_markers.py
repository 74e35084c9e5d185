"""OpenAI prompt-cache hints, shared by Chat and Responses: breakpoints, options, the write cap.

Hints never change the prompt: a breakpoint becomes a shared-prefix write candidate when it
maps to an exact token frontier (the prompt builder decides), and at most four writes are
kept per request: the implicit candidate takes a slot unless it coincides with an explicit
one, and the remaining slots go to the latest explicit breakpoints.
"""

from __future__ import annotations

from ninfer.frontend.conversation import Message, TextPart
from ninfer.server.errors import invalid
from ninfer.server.validation.fields import enum_value, optional_object, optional_str

CACHE_TTLS = ("30m", "12h")
PROMPT_CACHE_RETENTIONS = ("in_memory", "24h")
MAX_CACHE_WRITES = 4


def breakpoint_marker(raw: dict, path: str) -> dict | None:
    """A part's prompt_cache_breakpoint, validated; None when absent."""
    marker = optional_object(raw, "prompt_cache_breakpoint", f"{path}.prompt_cache_breakpoint")
    if marker is None:
        return None
    if marker.get("mode") != "explicit":
        raise invalid(f"{path}.prompt_cache_breakpoint.mode", "prompt_cache_breakpoint.mode must be explicit")
    enum_value(marker, "ttl", f"{path}.prompt_cache_breakpoint.ttl", CACHE_TTLS)
    return dict(marker)


def implicit_candidate(body: dict) -> bool:
    """prompt_cache_options: omitted or mode implicit keeps the implicit candidate; explicit drops it."""
    options = optional_object(body, "prompt_cache_options", "prompt_cache_options")
    if options is None:
        return True
    enum_value(options, "ttl", "prompt_cache_options.ttl", CACHE_TTLS)
    # Diagnostics are an optional OpenAI feature; without it the id is simply not compared.
    optional_str(options, "comparison_response_id", "prompt_cache_options.comparison_response_id")
    return enum_value(options, "mode", "prompt_cache_options.mode", ("implicit", "explicit")) != "explicit"


def check_advisory_cache_fields(body: dict) -> str | None:
    """prompt_cache_key and prompt_cache_retention: accepted hints; returns the retention."""
    optional_str(body, "prompt_cache_key", "prompt_cache_key")
    return enum_value(body, "prompt_cache_retention", "prompt_cache_retention", PROMPT_CACHE_RETENTIONS)


def limit_cache_writes(messages: list[Message], explicit: list[TextPart], implicit: bool) -> None:
    """Keep at most four writes (module docstring); earlier markers stay in the input but write nothing."""
    target = None
    if implicit and messages:
        texts = [p for p in messages[-1].content if isinstance(p, TextPart)]
        target = texts[-1] if texts else None  # where the prompt builder places the implicit candidate
    slots = MAX_CACHE_WRITES if target is None or any(p is target for p in explicit) else MAX_CACHE_WRITES - 1
    keep = explicit[-slots:]
    for part in explicit:
        if not any(part is kept for kept in keep):
            part.cache_breakpoint = False
