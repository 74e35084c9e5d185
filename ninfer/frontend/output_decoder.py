"""OutputDecoder: splits one Qwen request's committed output stream into reasoning, content and
tool-call events, shared by Chat Completions, Responses and Anthropic Messages.

Channels. With thinking on, the generation prompt already ends in `<think>\\n`, so the model
writes reasoning without an opener, then `\\n</think>\\n\\n`, then content. The newline before
`</think>`, the tag and the newlines that start the content are markup, not text: the chat
template re-adds them (`reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n')`), so
replaying reasoning_content and content re-renders the same tokens. A stream that ends inside
reasoning is all reasoning. With thinking off everything is content.

Holding. Text streams as soon as it cannot turn out to be markup:
- in reasoning, only a tail that is a proper prefix of `\\n</think>` is held;
- at content start, newlines are dropped (template markup) until the first other character;
- in content with tools enabled, a tail that is a proper prefix of a region opener is held,
  together with the run of newlines right before it: the template writes `\\n\\n` between
  content and the first `<tool_call>`, so those newlines are markup when a call follows.
  Once an opener is complete, the whole region is held until `finish()` and parsed there
  (values may contain `</tool_call>`, so the region has no earlier reliable end). A parsed
  region becomes tool-call events; a fallback returns the held newlines and region to content
  byte for byte.

Reasoning tokens are the committed tokens while the reasoning channel is open, the
`</think>` token included (it belongs to the thinking phase, like the budget's forced close).
Counting follows token ids when `think_end_token_id` is known, so text held back by the engine
(UTF-8, stop strings) does not shift the count; a close seen only in text (no such id) counts
the whole delta that carried it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ninfer.frontend.tool_call_parser import (
    ParsedToolCall,
    ToolCallParseDiagnostics,
    ToolCallParser,
    region_openers,
)

THINK_CLOSE = "</think>"
_REASONING_MARKERS = ("\n" + THINK_CLOSE, THINK_CLOSE)


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int
    arguments: str  # the complete arguments JSON text; equals the concatenated deltas


DecoderEvent = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd


class _Channel(enum.Enum):
    REASONING = enum.auto()
    CONTENT_START = enum.auto()  # after </think>: leading newlines are markup
    CONTENT = enum.auto()
    TOOL_REGION = enum.auto()  # a complete opener was seen; held until finish()


class OutputDecoder:
    def __init__(
        self,
        thinking: bool,
        tools: Mapping[str, Mapping[str, Any] | None] | None = None,
        tolerant: bool = False,
        think_end_token_id: int | None = None,
    ):
        """`tools`: callable tool name -> parameters JSON Schema; None or empty disables tool
        parsing (e.g. tool_choice none), so tool markup is ordinary content."""
        self._channel = _Channel.REASONING if thinking else _Channel.CONTENT
        self._parser = ToolCallParser(tools, tolerant) if tools else None
        self._openers = region_openers(tolerant)
        self._think_end_token_id = think_end_token_id
        self._counting_reasoning = thinking  # token-side view of the reasoning channel
        self._reasoning_tokens = 0
        self._forced_tokens = 0
        self._pending = ""  # text not yet assigned to a channel (short, except in a region)
        self._separator = ""  # newlines between content and the region opener
        self._region: list[str] = []
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._tool_calls: tuple[ParsedToolCall, ...] = ()
        self._diagnostics = ToolCallParseDiagnostics()
        self._finished = False

    # -- public ---------------------------------------------------------------------------------

    def feed(self, token_ids: Sequence[int], text: str, forced_token_count: int = 0) -> list[DecoderEvent]:
        """One engine delta: its committed token ids and their (UTF-8-complete, stop-trimmed) text."""
        if self._finished:
            raise RuntimeError("feed after finish")
        self._count_tokens(token_ids)
        self._forced_tokens += forced_token_count
        events: list[DecoderEvent] = []
        if self._channel is _Channel.TOOL_REGION:
            self._region.append(text)
        else:
            self._pending += text
            self._advance(events, final=False)
        if self._channel is not _Channel.REASONING:
            self._counting_reasoning = False  # a close seen only as text
        return events

    def finish(self) -> list[DecoderEvent]:
        """The end of the output: release held text and resolve a held tool region."""
        if self._finished:
            raise RuntimeError("finish called twice")
        self._finished = True
        events: list[DecoderEvent] = []
        self._advance(events, final=True)
        return events

    @property
    def reasoning_open(self) -> bool:
        """Whether `</think>` has not been seen yet (thinking on): a thinking block may still grow."""
        return self._channel is _Channel.REASONING

    @property
    def reasoning_tokens(self) -> int:
        return self._reasoning_tokens

    @property
    def forced_tokens(self) -> int:
        """Tokens the engine committed without sampling (thinking-budget close), as reported."""
        return self._forced_tokens

    @property
    def reasoning_text(self) -> str:
        return "".join(self._reasoning)

    @property
    def content_text(self) -> str:
        return "".join(self._content)

    @property
    def tool_calls(self) -> tuple[ParsedToolCall, ...]:
        return self._tool_calls

    @property
    def diagnostics(self) -> ToolCallParseDiagnostics:
        return self._diagnostics

    # -- channels -------------------------------------------------------------------------------

    def _count_tokens(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            if not self._counting_reasoning:
                return
            self._reasoning_tokens += 1
            if token_id == self._think_end_token_id:
                self._counting_reasoning = False

    def _advance(self, events: list[DecoderEvent], final: bool) -> None:
        while True:
            if self._channel is _Channel.REASONING:
                close = self._pending.find(THINK_CLOSE)
                if close < 0:
                    held = 0 if final else _partial_marker_length(self._pending, _REASONING_MARKERS)
                    self._emit_reasoning(events, self._release(len(self._pending) - held))
                    return
                body = self._pending[:close]
                self._emit_reasoning(events, body.removesuffix("\n"))
                self._pending = self._pending[close + len(THINK_CLOSE) :]
                self._channel = _Channel.CONTENT_START
            elif self._channel is _Channel.CONTENT_START:
                self._pending = self._pending.lstrip("\n")
                if not self._pending:
                    return
                self._channel = _Channel.CONTENT
            elif self._channel is _Channel.CONTENT:
                if self._parser is None:
                    self._emit_content(events, self._release(len(self._pending)))
                    return
                opener = _first_opener(self._pending, self._openers)
                if opener < 0:
                    held = 0 if final else self._possible_separator_and_opener()
                    self._emit_content(events, self._release(len(self._pending) - held))
                    return
                start = _newline_run_before(self._pending[:opener], 0)
                self._emit_content(events, self._pending[: opener - start])
                self._separator = self._pending[opener - start : opener]
                self._region = [self._pending[opener:]]
                self._pending = ""
                self._channel = _Channel.TOOL_REGION
            else:
                if final:
                    self._resolve_region(events)
                return

    def _resolve_region(self, events: list[DecoderEvent]) -> None:
        assert self._parser is not None
        region = "".join(self._region)
        self._region = []
        result = self._parser.parse(region)
        self._diagnostics = result.diagnostics
        if not result.structured:
            self._emit_content(events, self._separator + region)
            return
        self._tool_calls = result.calls
        for call in result.calls:
            events.append(ToolCallStart(call.index, call.name))
            events.extend(ToolCallArgumentsDelta(call.index, piece) for piece in call.argument_pieces())
            events.append(ToolCallEnd(call.index, call.arguments))
        self._emit_content(events, result.trailing_text)

    def _possible_separator_and_opener(self) -> int:
        """Length of the held content tail: a partial opener and the newlines before it."""
        return _newline_run_before(self._pending, _partial_marker_length(self._pending, self._openers))

    def _release(self, length: int) -> str:
        released, self._pending = self._pending[:length], self._pending[length:]
        return released

    def _emit_reasoning(self, events: list[DecoderEvent], text: str) -> None:
        if text:
            self._reasoning.append(text)
            events.append(ReasoningDelta(text))

    def _emit_content(self, events: list[DecoderEvent], text: str) -> None:
        if text:
            self._content.append(text)
            events.append(ContentDelta(text))


def _partial_marker_length(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:length]):
                best = length
                break
    return best


def _newline_run_before(text: str, tail: int) -> int:
    """`tail` extended backwards over the newlines that precede the last `tail` characters."""
    end = len(text) - tail
    start = end
    while start > 0 and text[start - 1] == "\n":
        start -= 1
    return tail + (end - start)


def _first_opener(text: str, openers: Sequence[str]) -> int:
    found = [index for index in (text.find(opener) for opener in openers) if index >= 0]
    return min(found, default=-1)
