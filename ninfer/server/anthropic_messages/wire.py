"""Anthropic Messages wire shapes: the aggregate Message and the SSE lifecycle.

message_start is sent after admission committed the prefix selection, so its uncached and
cache-read split is already exact; then ping, the content blocks (blocks.py), message_delta
with the stop reason and cumulative usage, and message_stop. A failure after the stream
started is an `error` event carrying request_id.
"""

from __future__ import annotations

from typing import Any

from ninfer.contract.output import FinishReason
from ninfer.server.anthropic_messages.blocks import BlockAssembler, SseEvent
from ninfer.server.anthropic_messages.request import MessagesRequest
from ninfer.server.endpoint import Wire
from ninfer.server.errors import APIError
from ninfer.server.generation import FinishEvent, Generation
from ninfer.server.sse import event_frame


class MessagesWire(Wire):
    def __init__(self, message_id: str, parsed: MessagesRequest, generation: Generation, request_id: str):
        self.id = message_id
        self.parsed = parsed
        self.generation = generation
        self.request_id = request_id
        self.blocks = BlockAssembler(thinking_omitted=parsed.thinking_omitted)
        self.stop: tuple[str | None, str | None] = (None, None)

    def begin(self) -> list[bytes]:
        start = self._message([], (None, None), final=False)
        return _frames([("message_start", {"type": "message_start", "message": start}), ("ping", {"type": "ping"})])

    def output(self, event: object) -> list[bytes]:
        events = self.blocks.feed(event)
        if not self.generation.decoder.reasoning_open:
            events += self.blocks.end_thinking()  # a thinking block closes as soon as reasoning ends
        return _frames(events)

    def finish(self, event: FinishEvent) -> list[bytes]:
        events = self.blocks.close()
        self.stop = self._stop(event)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": self.stop[0], "stop_sequence": self.stop[1]},
            "usage": self._usage(final=True),
        }
        return _frames([*events, ("message_delta", delta), ("message_stop", {"type": "message_stop"})])

    def error(self, error: APIError) -> list[bytes]:
        return [event_frame("error", error.anthropic_body(self.request_id))]

    def body(self) -> dict[str, Any]:
        return self._message(self.blocks.content, self.stop, final=True)

    def _usage(self, *, final: bool) -> dict:
        """input_tokens excludes the reused prefix; cache creation is unknown (null)."""
        usage = self.generation.usage
        shaped: dict = {
            "input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": None,
            "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens if final else 0,
        }
        if final:
            shaped["output_tokens_details"] = {"thinking_tokens": usage.reasoning_tokens}
        return shaped

    def _stop(self, event: FinishEvent) -> tuple[str, str | None]:
        """stop_reason and stop_sequence of a finished generation."""
        if event.reason is FinishReason.LENGTH:
            # The engine clamps the output to the context ceiling; stopping short of max_tokens means that ceiling.
            if self.generation.completion_tokens < self.generation.max_tokens:
                return "model_context_window_exceeded", None
            return "max_tokens", None
        if isinstance(event.stop_reason, str) and event.stop_reason in self.parsed.stop_sequences:
            return "stop_sequence", event.stop_reason
        return ("tool_use" if self.blocks.tool_calls else "end_turn"), None

    def _message(self, content: list[dict], stop: tuple[str | None, str | None], *, final: bool) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.parsed.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": self._usage(final=final),
        }


def _frames(events: list[SseEvent]) -> list[bytes]:
    return [event_frame(name, payload) for name, payload in events]
