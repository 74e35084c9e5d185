"""ResponseAssembler: one Response's output Items and the semantic SSE events that build them.

The aggregate body and the stream fold the same decoder events through this class, so the
concatenated deltas equal the terminal Items by construction. Output order is the one an
assistant turn can be replayed in: reasoning, then the message, then function calls. The decoder
releases a tool region (its calls and any tolerant trailing text) only at the end of the output,
so holding those events until the finish costs no latency and lets trailing text join the
message before the calls are announced. With log probabilities, each output_text delta carries
the entries its text released (answer_logprobs.py) and the output_text part all of them.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable
from typing import Any

from ninfer.frontend.output_decoder import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from ninfer.server.errors import APIError
from ninfer.server.openai_responses.items import new_item_id
from ninfer.server.openai_responses.tools import FunctionRef
from ninfer.server.reasoning_envelope import seal

# Response object members in OpenAI's order (the SDK does not care; humans reading logs do).
_RESPONSE_FIELDS = (
    "id", "object", "created_at", "status", "background", "completed_at", "error", "incomplete_details",
    "instructions", "max_output_tokens", "max_tool_calls", "model", "output", "parallel_tool_calls",
    "previous_response_id", "prompt_cache_key", "prompt_cache_retention", "reasoning", "safety_identifier",
    "service_tier", "store", "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p",
    "truncation", "usage", "user", "metadata",
)  # fmt: skip
# A cancelled Response ends with the event named after its status, as the others do.
_TERMINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed",
                    "cancelled": "response.cancelled"}


class ResponseAssembler:
    def __init__(
        self,
        response_id: str,
        config: dict[str, Any],
        functions: dict[str, FunctionRef],
        encrypted_reasoning: bool = False,
        take_logprobs: Callable[[], list[dict]] | None = None,
    ):
        """`config`: the request configuration the Response object repeats (model, tools, ...);
        encrypted_reasoning: reasoning Items also carry their text sealed as encrypted_content;
        take_logprobs: the answer entries not yet sent (with log probabilities)."""
        self.id = response_id
        self.encrypted_reasoning = encrypted_reasoning
        self.created_at = int(time.time())
        self.config = config
        self.functions = functions
        self.output: list[dict[str, Any]] = []
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the reasoning or message Item receiving deltas
        self._open_text: list[str] = []
        self._open_logprobs: list[dict] = []
        self.take_logprobs = take_logprobs
        self._message: dict[str, Any] | None = None
        self._held: list[object] = []  # a tool region's events, released at the finish

    # ---- lifecycle ---------------------------------------------------------------------------
    def begin(self) -> list[dict]:
        return [
            self._event("response.created", response=self.snapshot("in_progress")),
            self._event("response.in_progress", response=self.snapshot("in_progress")),
        ]

    def feed(self, event: object) -> list[dict]:
        """One decoder event; returns the SSE events it produces now."""
        if self._held or isinstance(event, ToolCallStart):
            self._held.append(event)
            return []
        if isinstance(event, ReasoningDelta):
            return self._delta("reasoning", event.text)
        if isinstance(event, ContentDelta):
            return self._delta("message", event.text)
        return []

    def finish_output(self, incomplete: bool, reasoning_cut: bool) -> list[dict]:
        """Close the open Item, add the held function calls; `reasoning_cut`: output ended in reasoning."""
        held, self._held = self._held, []
        events: list[dict] = []
        for event in held:
            if isinstance(event, ContentDelta):
                events += self._delta("message", event.text)
        has_calls = any(isinstance(event, ToolCallStart) for event in held)
        if self._open is not None:
            cut = incomplete and (reasoning_cut if self._open["type"] == "reasoning" else not has_calls)
            events += self._close("incomplete" if cut else "completed")
        if not incomplete and self._message is None and not has_calls:
            # A completed turn that said nothing is still a turn: replaying it must render one.
            events += self._delta("message", "")
            events += self._close("completed")
        for event in held:
            events += self._tool_event(event)
        return events

    def terminal(self, response: dict[str, Any]) -> dict:
        """The one terminal event (response.completed / .incomplete / .cancelled / .failed) carrying `response`."""
        return self._event(_TERMINAL_EVENTS[response["status"]], response=response)

    def cancel(self) -> list[dict]:
        """The generation was cancelled: what is open closes as incomplete, a held tool region
        (an unfinished call) is dropped."""
        self._held = []
        return self._close("incomplete") if self._open is not None else []

    def fail(self, error: APIError, usage: dict | None = None) -> list[dict]:
        """An error after the stream started: close what is open as incomplete, then response.failed."""
        self._held = []
        events = self._close("incomplete") if self._open is not None else []
        return [*events, self.terminal(self.snapshot("failed", usage, error))]

    def snapshot(self, status: str, usage: dict | None = None, error: APIError | None = None) -> dict[str, Any]:
        values = {
            **self.config,
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": _error_object(error) if error is not None else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": copy.deepcopy(self.output) if status != "in_progress" else [],
            "usage": usage,
        }
        return {key: values.get(key) for key in _RESPONSE_FIELDS}

    # ---- Items -------------------------------------------------------------------------------
    def _delta(self, kind: str, text: str) -> list[dict]:
        events: list[dict] = []
        if self._open is not None and self._open["type"] != kind:
            events += self._close("completed")
        if self._open is None:
            events += self._open_item(kind)
        item = self._open
        assert item is not None
        self._open_text.append(text)
        if text:
            if kind == "reasoning":
                events.append(self._event("response.reasoning_text.delta", **self._where(item), delta=text))
            else:
                logprobs = self.take_logprobs() if self.take_logprobs is not None else []
                self._open_logprobs.extend(logprobs)
                where = self._where(item)
                events.append(self._event("response.output_text.delta", **where, delta=text, logprobs=logprobs))
        return events

    def _open_item(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item: dict[str, Any] = {"id": new_item_id("reasoning"), "type": "reasoning", "summary": [], "content": [],
                                    "status": "in_progress"}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": new_item_id("message"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
            self._message = item
        self.output.append(item)
        self._open = item
        self._open_text = []
        self._open_logprobs = []
        return [
            self._event("response.output_item.added", output_index=len(self.output) - 1, item=copy.deepcopy(item)),
            self._event("response.content_part.added", **self._where(item), part=part),
        ]

    def _close(self, status: str) -> list[dict]:
        item = self._open
        assert item is not None
        text = "".join(self._open_text)
        where = self._where(item)
        if item["type"] == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            done = self._event("response.reasoning_text.done", **where, text=text)
        else:
            part = {"type": "output_text", "text": text, "annotations": []}
            if self.take_logprobs is not None:
                part["logprobs"] = self._open_logprobs
            done = self._event("response.output_text.done", **where, text=text, logprobs=self._open_logprobs)
        item["content"] = [part]
        if item["type"] == "reasoning" and self.encrypted_reasoning:
            item["encrypted_content"] = seal(text)
        item["status"] = status
        self._open = None
        self._open_text = []
        self._open_logprobs = []
        return [
            done,
            self._event("response.content_part.done", **where, part=copy.deepcopy(part)),
            self._event("response.output_item.done", output_index=where["output_index"], item=copy.deepcopy(item)),
        ]

    def _tool_event(self, event: object) -> list[dict]:
        if isinstance(event, ToolCallStart):
            ref = self.functions.get(event.name, FunctionRef(None, event.name))
            item: dict[str, Any] = {"id": new_item_id("function_call"), "type": "function_call",
                                    "call_id": "call_" + uuid.uuid4().hex, "name": ref.name}
            if ref.namespace is not None:
                item["namespace"] = ref.namespace
            item.update({"arguments": "", "status": "in_progress"})
            self.output.append(item)
            return [self._event("response.output_item.added", output_index=len(self.output) - 1,
                                item=copy.deepcopy(item))]
        item = self.output[-1]
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        if isinstance(event, ToolCallArgumentsDelta):
            item["arguments"] += event.text
            return [self._event("response.function_call_arguments.delta", **where, delta=event.text)]
        if isinstance(event, ToolCallEnd):
            item["status"] = "completed"
            return [
                self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=where["output_index"], item=copy.deepcopy(item)),
            ]
        return []

    def _where(self, item: dict) -> dict[str, Any]:
        index = next(i for i, candidate in enumerate(self.output) if candidate is item)
        return {"item_id": item["id"], "output_index": index, "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


def _error_object(error: APIError) -> dict[str, Any]:
    """ResponseError's codes are a closed set; the NInfer code stays visible in the message."""
    if error.status == 429:
        code = "rate_limit_exceeded"
    elif error.code in ("context_length_exceeded", "invalid_prompt"):
        code = "invalid_prompt"
    else:
        code = "server_error"
    return {"code": code, "message": f"{error.code}: {error.message}" if error.code else error.message,
            "param": error.param, "type": error.type}
