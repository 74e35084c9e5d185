"""Chat Completions wire shapes: aggregate chat.completion and chat.completion.chunk SSE.

The stream starts with an assistant-role chunk, sends reasoning and content deltas (with
cumulative timings when timings_per_token), prompt_progress chunks when return_progress, then
the finish-reason chunk, the usage chunk when include_usage, and [DONE]. Terminal timings sit
on the last JSON chunk. The aggregate folds the same deltas, so both agree by construction.
With logprobs, each content chunk carries the entries its text released (answer_logprobs.py)
and the aggregate choice all of them; otherwise `logprobs` is null.
"""

from __future__ import annotations

import time
from typing import Any

from ninfer.contract.output import FinishReason
from ninfer.frontend.output_decoder import ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallStart
from ninfer.server.endpoint import Wire
from ninfer.server.errors import APIError
from ninfer.server.generation import FinishEvent, Generation, ProgressEvent
from ninfer.server.openai_chat.request import ChatRequest
from ninfer.server.sse import DONE_FRAME, data_frame


class ChatWire(Wire):
    def __init__(self, completion_id: str, model: str, chat: ChatRequest, generation: Generation):
        self.id = completion_id
        self.model = model
        self.chat = chat
        self.generation = generation
        self.created = int(time.time())
        self.calls: list[dict] = []
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.logprobs: list[dict] = []  # every entry sent (with logprobs)
        self.finish_reason: str | None = None

    # ---- Wire --------------------------------------------------------------------------------
    def begin(self) -> list[bytes]:
        return [data_frame(self._chunk({"role": "assistant", "content": ""}))]

    def progress(self, event: ProgressEvent) -> list[bytes]:
        if not self.chat.return_progress:
            return []
        progress = event.progress
        shaped = {
            "total": progress.total,
            "cache": progress.cache,
            "processed": progress.processed,
            "time_ms": round(progress.time_ms),
        }
        return [data_frame(self._chunk(None, prompt_progress=shaped))]

    def output(self, event: object) -> list[bytes]:
        delta = self._record(event)
        if delta is None:
            return []
        extra = {"timings": self.generation.timings(terminal=False).to_dict()} if self.chat.timings_per_token else {}
        logprobs = None
        if isinstance(event, ContentDelta) and self.generation.logprobs is not None:
            entries = self.generation.take_logprobs()
            self.logprobs.extend(entries)
            logprobs = {"content": entries, "refusal": None}
        return [data_frame(self._chunk(delta, logprobs=logprobs, **extra))]

    def finish(self, event: FinishEvent) -> list[bytes]:
        if event.reason is FinishReason.LENGTH:
            self.finish_reason = "length"
        else:
            self.finish_reason = "tool_calls" if self.calls else "stop"
        timings = self.generation.timings().to_dict()
        if not self.chat.include_usage:
            return [data_frame(self._chunk({}, self.finish_reason, timings=timings)), DONE_FRAME]
        return [
            data_frame(self._chunk({}, self.finish_reason)),
            data_frame(self._chunk(None, usage=self._usage(), timings=timings)),
            DONE_FRAME,
        ]

    def error(self, error: APIError) -> list[bytes]:
        return [data_frame(error.openai_body())]

    def body(self) -> dict[str, Any]:
        logprobs = {"content": self.logprobs, "refusal": None} if self.generation.logprobs is not None else None
        choice = {"index": 0, "message": self._message(), "logprobs": logprobs, "finish_reason": self.finish_reason}
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(),
            "timings": self.generation.timings().to_dict(),
        }

    # ---- shapes ------------------------------------------------------------------------------
    def _usage(self) -> dict:
        usage = self.generation.usage
        return {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        }

    def _chunk(
        self, delta: dict | None, finish_reason: str | None = None, logprobs: dict | None = None, **extra
    ) -> dict:
        choices = [] if delta is None else [
            {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ]
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _record(self, event: object) -> dict | None:
        """Fold a decoder event into the aggregate state; returns its streaming delta."""
        if isinstance(event, ReasoningDelta):
            self.reasoning.append(event.text)
            return {"reasoning_content": event.text}
        if isinstance(event, ContentDelta):
            self.content.append(event.text)
            return {"content": event.text}
        if isinstance(event, ToolCallStart):
            call_id = Generation.new_id("call_")
            self.calls.append({"id": call_id, "type": "function", "function": {"name": event.name, "arguments": ""}})
            start = {"index": event.index, "id": call_id, "type": "function",
                     "function": {"name": event.name, "arguments": ""}}
            return {"tool_calls": [start]}
        if isinstance(event, ToolCallArgumentsDelta):
            self.calls[event.index]["function"]["arguments"] += event.text
            return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
        return None

    def _message(self) -> dict:
        content = "".join(self.content)
        message: dict = {"role": "assistant", "content": content if content or not self.calls else None}
        if self.generation.prepared.thinking:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = self.calls
        message["refusal"] = None
        return message
