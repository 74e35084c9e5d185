"""OpenAI prompt-cache hints, shared by Chat and Responses: breakpoints, options, the write cap.

Hints never change the prompt: a breakpoint becomes a shared-prefix write candidate when it
maps to an exact token frontier (the prompt builder decides), and at most four writes are
kept per request: the implicit candidate takes a slot unless it coincides with an explicit
one, and the remaining slots go to the latest explicit breakpoints.
"""

from __future__ import annotations

from ninfer.frontend.conversation import Message, TextPart
from ninfer.server.errors import invalid
from ninfer.server.validation.fields import Field, Fields, optional_object
from ninfer.server.validation.schema import const

CACHE_TTLS = ("30m", "12h")
PROMPT_CACHE_RETENTIONS = ("in_memory", "24h")
MAX_CACHE_WRITES = 4
# A text part's prompt_cache_breakpoint.
CACHE_BREAKPOINT = Fields({"mode": Field.shape(const("explicit")), "ttl": Field.choice(CACHE_TTLS)})
CACHE_BREAKPOINT_SCHEMA = CACHE_BREAKPOINT.schema(("mode",))
PROMPT_CACHE_OPTIONS = Fields(
    {
        "mode": Field.choice(("implicit", "explicit")),
        "ttl": Field.choice(CACHE_TTLS),
        # Diagnostics are an optional OpenAI feature; without it the id is simply not compared.
        "comparison_response_id": Field.string(),
    },
    "prompt_cache_options",
)
# The request members of the cache hints (Chat and Responses).
CACHE_HINTS = Fields(
    {
        "prompt_cache_key": Field.string(),
        "prompt_cache_retention": Field.choice(PROMPT_CACHE_RETENTIONS),
        "prompt_cache_options": PROMPT_CACHE_OPTIONS.member(),
    }
)


def breakpoint_marker(raw: dict, path: str) -> dict | None:
    """A part's prompt_cache_breakpoint, validated; None when absent."""
    marker = optional_object(raw, "prompt_cache_breakpoint", f"{path}.prompt_cache_breakpoint")
    if marker is None:
        return None
    if marker.get("mode") != "explicit":
        raise invalid(f"{path}.prompt_cache_breakpoint.mode", "prompt_cache_breakpoint.mode must be explicit")
    CACHE_BREAKPOINT.read(marker, "ttl", f"{path}.prompt_cache_breakpoint")
    return dict(marker)


def implicit_candidate(body: dict) -> bool:
    """prompt_cache_options: omitted or mode implicit keeps the implicit candidate; explicit drops it."""
    options = CACHE_HINTS.read(body, "prompt_cache_options")
    if options is None:
        return True
    PROMPT_CACHE_OPTIONS.read(options, "ttl")
    PROMPT_CACHE_OPTIONS.read(options, "comparison_response_id")
    return PROMPT_CACHE_OPTIONS.read(options, "mode") != "explicit"


def check_advisory_cache_fields(body: dict) -> str | None:
    """prompt_cache_key and prompt_cache_retention: accepted hints; returns the retention."""
    CACHE_HINTS.read(body, "prompt_cache_key")
    return CACHE_HINTS.read(body, "prompt_cache_retention")


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
