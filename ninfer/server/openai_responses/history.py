"""Item history -> Conversation: the prompt of a Responses request.

Instructions come first (as a developer turn for this request only), then the stored chain's
Items, then this request's. Contiguous assistant-owned Items form one assistant turn in the
representable order reasoning -> message content -> function calls; results are validated by
call_id and put in call order, because the Qwen prompt pairs results with calls by position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ninfer.frontend.conversation import Conversation, MediaPart, Message, Part, TextPart, ToolCall
from ninfer.server.errors import invalid
from ninfer.server.openai_responses.tools import tool_identity
from ninfer.server.validation.cache_markers import limit_cache_writes
from ninfer.server.validation.fields import json_object_text

if TYPE_CHECKING:
    from ninfer.server.openai_responses.request import ResponsesRequest

_ASSISTANT_STAGE = {"reasoning": 0, "message": 1, "function_call": 2}  # representable turn order


def build_conversation(
    request: ResponsesRequest, history: list[dict], inherited_preserve_thinking: bool | None
) -> Conversation:
    """The prompt of a request: instructions, the stored chain's Items, then this request's Items."""
    assembler = _HistoryAssembler()
    if request.instructions:
        assembler.messages.append(Message(role="developer", content=[TextPart(request.instructions)]))
    if not request.items and not any(i["type"] == "message" and i["role"] == "user" for i in history):
        raise invalid(
            "input", "input is required: the previous response holds no user query", code="missing_required_parameter"
        )
    for item in history:
        assembler.add(item, "previous_response_id", fresh=False)
    for item, path in zip(request.items, request.item_paths):
        assembler.add(item, path, fresh=True)
    messages = assembler.finish()
    limit_cache_writes(messages, assembler.fresh_breakpoints, request.implicit_cache_breakpoint)
    preserve = request.preserve_thinking if request.preserve_thinking is not None else inherited_preserve_thinking
    return Conversation(
        messages=messages,
        tools=list(request.tools),
        enable_thinking=request.enable_thinking,
        reasoning_effort=request.template_effort,
        preserve_thinking=preserve,
        implicit_cache_breakpoint=request.implicit_cache_breakpoint,
    )


@dataclass
class _PendingCalls:
    """Calls of the latest assistant turn that results may still answer, in declaration order."""

    calls: list[ToolCall]
    refs: list[tuple[str | None, str]]  # (namespace, name) per call
    answered: int = 0  # results so far, always a declaration-order prefix


class _HistoryAssembler:
    """Groups Items into turns: assistant-owned Items into one assistant message, results in call order."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.fresh_breakpoints: list[TextPart | MediaPart] = []  # explicit markers of this request, in order
        self._turn: Message | None = None
        self._turn_stage = 0
        self._turn_refs: list[tuple[str | None, str]] = []
        self._pending: _PendingCalls | None = None
        self._results: list[tuple[dict, str, bool]] = []

    def add(self, item: dict, path: str, fresh: bool) -> None:
        kind = item["type"]
        if kind == "function_call_output":
            self._close_turn()
            self._results.append((item, path, fresh))
            return
        self._flush_results()
        if kind in _ASSISTANT_STAGE and (kind != "message" or item["role"] == "assistant"):
            self._add_assistant(item, path, fresh)
            return
        self._close_turn()
        if item["role"] == "user":
            self._pending = None  # results after a new user turn cannot be placed
        role = item["role"]
        self.messages.append(Message(role=role, content=self._parts(item["content"], fresh, f"{path}.content")))

    def finish(self) -> list[Message]:
        self._flush_results()
        self._close_turn()
        return self.messages

    def _add_assistant(self, item: dict, path: str, fresh: bool) -> None:
        stage = _ASSISTANT_STAGE[item["type"]]
        if self._turn is None:
            self._turn = Message(role="assistant")
            self._turn_stage = 0
            self._turn_refs = []
            self._pending = None
            self.messages.append(self._turn)
        elif stage < self._turn_stage:
            raise invalid(
                path,
                f"{path}: a {item['type']} Item cannot follow a later part of the same assistant turn; "
                "one turn renders as reasoning, then message content, then function calls",
                code="invalid_assistant_history",
            )
        self._turn_stage = stage
        turn = self._turn
        if item["type"] == "reasoning":
            turn.reasoning = (turn.reasoning or "") + "".join(part["text"] for part in item["content"])
        elif item["type"] == "message":
            turn.content.extend(self._parts(item["content"], fresh, f"{path}.content"))
        else:
            call_id = item["call_id"]
            if any(call.call_id == call_id for call in turn.tool_calls):
                raise invalid(
                    f"{path}.call_id",
                    f"{path}.call_id {call_id!r} repeats an earlier call of this turn",
                    code="invalid_tool_history",
                )
            name, namespace = item["name"], item.get("namespace")
            turn.tool_calls.append(
                ToolCall(
                    name=tool_identity(namespace, name), arguments=json_object_text(item["arguments"]), call_id=call_id
                )
            )
            self._turn_refs.append((namespace, name))

    def _close_turn(self) -> None:
        if self._turn is not None and self._turn.tool_calls:
            self._pending = _PendingCalls(list(self._turn.tool_calls), list(self._turn_refs))
        self._turn = None

    def _flush_results(self) -> None:
        """Validate a run of results against the pending calls and render them in call order."""
        if not self._results:
            return
        results, self._results = self._results, []
        pending = self._pending
        ordered: dict[int, tuple[dict, str, bool]] = {}
        for item, path, fresh in results:
            call_id = item["call_id"]
            index = next((i for i, c in enumerate(pending.calls) if c.call_id == call_id), None) if pending else None
            if index is None:
                raise invalid(
                    f"{path}.call_id",
                    f"{path}.call_id {call_id!r} answers no call of the preceding assistant turn",
                    code="invalid_tool_history",
                )
            if index in ordered or index < pending.answered:
                raise invalid(
                    f"{path}.call_id", f"{path}.call_id {call_id!r} is answered twice", code="invalid_tool_history"
                )
            namespace, name = pending.refs[index]
            if item.get("name") not in (None, name) or item.get("namespace") not in (None, namespace):
                raise invalid(
                    path, f"{path}: name/namespace do not match call {call_id!r}", code="invalid_tool_history"
                )
            ordered[index] = (item, path, fresh)
        expected = list(range(pending.answered, pending.answered + len(ordered)))
        if sorted(ordered) != expected:
            # The Qwen prompt pairs results with calls by position only.
            path = results[0][1]
            raise invalid(
                path,
                f"{path}: results must answer the calls in a leading run of their declaration "
                "order; this partial result set cannot be represented",
                code="invalid_tool_history",
            )
        pending.answered += len(ordered)
        for index in expected:
            item, path, fresh = ordered[index]
            output = item["output"]
            content = self._parts(output, fresh, f"{path}.output") if isinstance(output, list) else [TextPart(output)]
            self.messages.append(Message(role="tool", content=content, tool_call_id=item["call_id"]))

    def _parts(self, parts: list[dict], fresh: bool, path: str) -> list[Part]:
        """path: the field holding the parts (media errors name the part's URL field under it)."""
        out: list[Part] = []
        for index, part in enumerate(parts):
            if part["type"] in ("input_image", "input_video"):
                key = "image_url" if part["type"] == "input_image" else "video_url"
                kind = "image" if part["type"] == "input_image" else "video"
                media = MediaPart(kind, part[key], fresh and "prompt_cache_breakpoint" in part, f"{path}[{index}].{key}")
                if media.cache_breakpoint:
                    self.fresh_breakpoints.append(media)
                out.append(media)
                continue
            text = part["refusal"] if part["type"] == "refusal" else part["text"]
            marked = fresh and "prompt_cache_breakpoint" in part
            text_part = TextPart(text, cache_breakpoint=marked)
            if marked:
                self.fresh_breakpoints.append(text_part)
            out.append(text_part)
        return out
