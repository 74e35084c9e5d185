"""BlockAssembler: decoder events -> Anthropic content blocks, as SSE events and as final content.

The aggregate response and the stream run the same assembler, so the content a client
accumulates from content_block_start/delta/stop equals the aggregate `content` by
construction. Block lifecycle: a thinking block ends with its signature_delta and then its
content_block_stop; a text block ends when anything else starts; a tool_use block streams
its arguments as input_json_delta and ends with the call.

The thinking signature is NInfer's reversible envelope of the block's text, so a client that
replays the block (with or without its text) renders the same prompt. With display "omitted"
the block carries no thinking text at all: no thinking_delta, only the signature.
"""

from __future__ import annotations

import json
import uuid

from ninfer.frontend.output_decoder import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from ninfer.server.reasoning_envelope import seal

SseEvent = tuple[str, dict]  # (event name, JSON payload whose "type" is that name)


class BlockAssembler:
    def __init__(self, thinking_omitted: bool = False) -> None:
        self.thinking_omitted = thinking_omitted
        self.content: list[dict] = []  # finished and open blocks, in wire order
        self._open: dict | None = None  # the block being streamed
        self._pieces: list[str] = []  # its text (or arguments JSON) so far
        self.tool_calls = 0

    def feed(self, event: object) -> list[SseEvent]:
        """One decoder event; returns the SSE events it produces (none for unknown events)."""
        if isinstance(event, ReasoningDelta):
            return self._delta("thinking", {"type": "thinking_delta", "thinking": event.text}, event.text)
        if isinstance(event, ContentDelta):
            return self._delta("text", {"type": "text_delta", "text": event.text}, event.text)
        if isinstance(event, ToolCallStart):
            self.tool_calls += 1
            block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": event.name, "input": {}}
            return [*self.close(), *self._start(block)]
        if isinstance(event, ToolCallArgumentsDelta):
            self._pieces.append(event.text)
            delta = {"type": "input_json_delta", "partial_json": event.text}
            return [("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})]
        if isinstance(event, ToolCallEnd):
            # The complete arguments text equals the deltas; json.loads keeps the model's member order.
            assert self._open is not None and self._open["type"] == "tool_use"
            self._pieces = [event.arguments]
            return self.close()
        return []

    def end_thinking(self) -> list[SseEvent]:
        """Close an open thinking block as soon as the reasoning channel has ended."""
        return self.close() if self._open is not None and self._open["type"] == "thinking" else []

    def close(self) -> list[SseEvent]:
        """Finish the open block, if any."""
        block = self._open
        if block is None:
            return []
        self._open = None
        text = "".join(self._pieces)
        self._pieces = []
        events: list[SseEvent] = []
        if block["type"] == "thinking":
            block["thinking"] = "" if self.thinking_omitted else text
            block["signature"] = seal(text)
            delta = {"type": "signature_delta", "signature": block["signature"]}
            events.append(
                ("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})
            )
        elif block["type"] == "text":
            block["text"] = text
        else:
            block["input"] = json.loads(text) if text else {}
        events.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        return events

    @property
    def _index(self) -> int:
        return len(self.content) - 1

    def _delta(self, kind: str, delta: dict, text: str) -> list[SseEvent]:
        events: list[SseEvent] = []
        if self._open is None or self._open["type"] != kind:
            events += self.close()
            events += self._start(
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
        self._pieces.append(text)
        if kind == "thinking" and self.thinking_omitted:
            return events  # the text reaches the client only inside the signature
        events.append(("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}))
        return events

    def _start(self, block: dict) -> list[SseEvent]:
        self.content.append(block)
        self._open = block
        start = {"type": "content_block_start", "index": self._index, "content_block": dict(block)}
        return [("content_block_start", start)]
