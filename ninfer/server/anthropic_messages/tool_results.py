"""Tool results in Messages history: paired with the calls of the turn before, put in call order.

Each visible tool_use turn must be answered by exactly one leading tool_result per id in the
next User turn; results are reordered to the calls' order because the Qwen prompt pairs them
by position. Results that open the history need no calls (a truncated or imported conversation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer.frontend.conversation import Message, TextPart, ToolCall
from ninfer.server.errors import APIError, invalid


@dataclass
class Turn:
    role: str
    path: str
    parts: list[TextPart] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    call_paths: list[str] = field(default_factory=list)
    results: list[tuple[str, Message, str]] = field(default_factory=list)  # (tool_use_id, tool message, path)
    content_before_result: str | None = None  # path of a non-result block seen before a later result


def pair_tool_results(turns: list[Turn]) -> list[Message]:
    """Each visible tool_use turn is answered by exactly one leading result per id in the next
    User turn; results are put in call order. Results opening the history need no calls."""
    messages: list[Message] = []
    pending: Turn | None = None  # the last Assistant turn with calls, until its results arrive
    opened = False  # a User or Assistant turn was seen (results can no longer open the history)
    for turn in turns:
        if turn.role == "system":
            messages.append(Message(role="system", content=turn.parts))
            continue
        if turn.role == "assistant":
            if pending is not None:
                raise _missing_results(pending, [c.call_id for c in pending.calls], turn.path)
            reasoning = "".join(turn.thinking) if turn.thinking else None
            messages.append(
                Message(role="assistant", content=turn.parts, reasoning=reasoning, tool_calls=turn.calls)
            )
            _check_unique_ids(turn)
            pending = turn if turn.calls else None
        else:
            results = (
                _ordered_results(turn, pending) if pending is not None else _opening_results(turn, opened)
            )
            messages += results
            if turn.parts or not results:
                messages.append(Message(role="user", content=turn.parts))
            pending = None
        opened = True
    if pending is not None:
        raise _missing_results(pending, [c.call_id for c in pending.calls], None)
    return messages

def _opening_results(turn: Turn, opened: bool) -> list[Message]:
    if not turn.results:
        return []
    call_id, _, path = turn.results[0]
    if opened:
        raise invalid(path, f"{path}: tool_result {call_id!r} has no tool_use in the preceding assistant turn")
    seen: set[str] = set()
    for call_id, _, path in turn.results:
        if call_id in seen:
            raise invalid(f"{path}.tool_use_id", f"{path}: a second tool_result for {call_id!r}")
        seen.add(call_id)
    return [message for _, message, _ in turn.results]


def _check_unique_ids(turn: Turn) -> None:
    seen: set[str] = set()
    for call, path in zip(turn.calls, turn.call_paths):
        if call.call_id in seen:
            raise invalid(f"{path}.id", f"{path}.id {call.call_id!r} is used twice in one assistant turn")
        seen.add(call.call_id)


def _ordered_results(turn: Turn, calls_turn: Turn) -> list[Message]:
    declared = [call.call_id for call in calls_turn.calls]
    by_id: dict[str, Message] = {}
    for call_id, message, path in turn.results:
        if call_id not in declared:
            raise invalid(
                f"{path}.tool_use_id",
                f"{path}: tool_result {call_id!r} answers no tool_use of the preceding assistant turn",
            )
        if call_id in by_id:
            raise invalid(f"{path}.tool_use_id", f"{path}: a second tool_result for {call_id!r}")
        by_id[call_id] = message
    missing = [call_id for call_id in declared if call_id not in by_id]
    if missing:
        raise _missing_results(calls_turn, missing, turn.path)
    return [by_id[call_id] for call_id in declared]


def _missing_results(calls_turn: Turn, missing: list[str | None], where: str | None) -> APIError:
    ids = ", ".join(repr(call_id) for call_id in missing)
    after = f"; {where} does not provide them" if where else ""
    return invalid(
        calls_turn.path,
        f"{calls_turn.path}: tool_use ids {ids} need one leading tool_result each in the next user turn{after}",
    )
