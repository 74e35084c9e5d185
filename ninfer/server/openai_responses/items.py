"""Responses input Items validated into their normalized wire form.

Ids are kept when supplied and generated otherwise (duplicates fail); string content expands
into parts. These dicts are what input_items lists and what a stored chain replays, so one
converter (history.py) turns any Item history into a prompt. A reasoning Item must carry its
raw reasoning text, given as content or inside an envelope NInfer issued as encrypted_content
(clients replay both; explicit nulls are accepted).
"""

from __future__ import annotations

import uuid
from typing import Any

from ninfer.server.errors import invalid
from ninfer.server.reasoning_envelope import open_envelope
from ninfer.server.validation.cache_markers import breakpoint_marker
from ninfer.server.validation.fields import (
    cannot_provide,
    enum_value,
    json_object_text,
    optional_bool,
    optional_list,
    optional_object,
    optional_str,
    required_str,
    wrong_type,
)
from ninfer.server.validation.media import check_detail, media_part

ITEM_STATUSES = ("in_progress", "completed", "incomplete")
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
# Item types of hosted tools and server features: recognised, not executable here.
UNSUPPORTED_ITEMS = {
    "item_reference": "Item references (send the Item itself or use previous_response_id)",
    "custom_tool_call": "custom tool calls",
    "custom_tool_call_output": "custom tool results",
    "compaction": "compaction Items",
    "mcp_call": "remote MCP calls",
    "mcp_list_tools": "remote MCP tool listings",
    "mcp_approval_request": "remote MCP approvals",
    "mcp_approval_response": "remote MCP approvals",
}
_ID_PREFIX = {"message": "msg_", "reasoning": "rs_", "function_call": "fc_", "function_call_output": "fco_"}


def new_item_id(kind: str) -> str:
    return _ID_PREFIX[kind] + uuid.uuid4().hex


def text_part(kind: str, text: str) -> dict:
    return {"type": kind, "text": text, "annotations": []} if kind == "output_text" else {"type": kind, "text": text}


def parse_input(raw: Any, has_previous: bool, vision_enabled: bool) -> tuple[list[dict], list[str]]:
    """The normalized Items and the input[i] path of each (for errors found while assembling history)."""
    if raw is None or raw == "" or raw == []:
        if not has_previous:
            raise invalid(
                "input",
                "input is required unless previous_response_id supplies the conversation",
                code="missing_required_parameter",
            )
        return [], []
    if isinstance(raw, str):
        message = {
            "id": new_item_id("message"),
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": raw}],
            "status": "completed",
        }
        return [message], ["input"]
    if not isinstance(raw, list):
        raise wrong_type("input", "a string or an array of Items", raw)
    parser = _ItemParser(vision_enabled)
    items: list[dict] = []
    paths: list[str] = []
    seen: dict[str, str] = {}
    for i, item in enumerate(raw):
        path = f"input[{i}]"
        supplied = item.get("id") if isinstance(item, dict) else None
        normalized = parser.item(item, path)
        if supplied is not None:
            if supplied in seen:
                raise invalid(
                    f"{path}.id", f"{path}.id {supplied!r} repeats the id of {seen[supplied]}", code="duplicate_item_id"
                )
            seen[supplied] = path
        items.append(normalized)
        paths.append(path)
    return items, paths


class _ItemParser:
    def __init__(self, vision_enabled: bool):
        self.vision_enabled = vision_enabled

    def item(self, raw: Any, path: str) -> dict:
        if not isinstance(raw, dict):
            raise wrong_type(path, "an object", raw)
        kind = optional_str(raw, "type", f"{path}.type")
        if kind is None and "role" in raw:
            kind = "message"
        if kind is None:
            raise invalid(f"{path}.type", f"{path}.type is required", code="missing_required_parameter")
        item_id = optional_str(raw, "id", f"{path}.id")
        if item_id is not None and not item_id:
            raise invalid(f"{path}.id", f"{path}.id must not be empty")
        if kind == "message":
            item = self._message(raw, path)
        elif kind == "reasoning":
            item = _reasoning(raw, path)
        elif kind == "function_call":
            item = _function_call(raw, path)
        elif kind == "function_call_output":
            item = self._function_call_output(raw, path)
        elif kind in UNSUPPORTED_ITEMS:
            raise cannot_provide(f"{path}.type", UNSUPPORTED_ITEMS[kind])
        else:
            raise cannot_provide(f"{path}.type", f"{kind} Items (hosted tools and server features are not available)")
        return {"id": item_id or new_item_id(kind), **item}

    def _message(self, raw: dict, path: str) -> dict:
        role = required_str(raw, "role", f"{path}.role")
        if role not in MESSAGE_ROLES:
            raise invalid(f"{path}.role", f"{path}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}")
        # Status and phase have no Qwen prompt representation; they are kept as metadata.
        status = enum_value(raw, "status", f"{path}.status", ITEM_STATUSES)
        phase = optional_str(raw, "phase", f"{path}.phase")
        content = raw.get("content")
        cpath = f"{path}.content"
        if content is None:
            raise invalid(cpath, f"{cpath} is required", code="missing_required_parameter")
        if isinstance(content, str):
            parts = [text_part("output_text" if role == "assistant" else "input_text", content)]
        elif isinstance(content, list):
            parts = [self._part(part, role, f"{cpath}[{i}]") for i, part in enumerate(content)]
        else:
            raise wrong_type(cpath, "a string or an array of content parts", content)
        item: dict[str, Any] = {"type": "message", "role": role, "content": parts, "status": status or "completed"}
        if phase is not None:
            item["phase"] = phase
        return item

    def _part(self, raw: Any, role: str, path: str) -> dict:
        if not isinstance(raw, dict):
            raise wrong_type(path, "an object", raw)
        kind = required_str(raw, "type", f"{path}.type")
        if kind in ("input_text", "output_text"):
            text = required_str(raw, "text", f"{path}.text")
            if kind == "output_text" and role != "assistant":
                raise invalid(f"{path}.type", f"{path}: output_text parts replay assistant messages")
            part = text_part("output_text" if role == "assistant" else "input_text", text)
            if kind == "output_text":
                annotations = optional_list(raw, "annotations", f"{path}.annotations")
                part["annotations"] = list(annotations or [])
            marker = breakpoint_marker(raw, path) if kind == "input_text" else None
            if marker is not None:
                part["prompt_cache_breakpoint"] = marker
            return part
        if kind == "refusal":
            if role != "assistant":
                raise invalid(f"{path}.type", f"{path}: refusal parts replay assistant messages")
            return {"type": "refusal", "refusal": required_str(raw, "refusal", f"{path}.refusal")}
        if kind in ("input_image", "input_video"):
            if role not in ("user", "assistant"):
                raise invalid(f"{path}.type", f"{path}: {kind} parts belong to user or assistant messages")
            return self._media(raw, kind, path)
        if kind == "input_file":
            raise cannot_provide(path, "file input")
        if kind == "input_audio":
            raise cannot_provide(path, "audio input")
        raise invalid(f"{path}.type", f"{path}.type {kind!r} is not a supported content part type")

    def _media(self, raw: dict, kind: str, path: str) -> dict:
        """An image/video part, normalised (its URL under image_url / video_url, detail auto)."""
        detail = None
        if kind == "input_image":
            if raw.get("file_id") is not None:
                raise cannot_provide(f"{path}.file_id", "file-id images (send an image_url)")
            detail = optional_str(raw, "detail", f"{path}.detail")
            check_detail(detail, f"{path}.detail")
        key = "image_url" if kind == "input_image" else "video_url"
        url = required_str(raw, key, f"{path}.{key}")
        media_part("image" if kind == "input_image" else "video", url, path, f"{path}.{key}", self.vision_enabled)
        part: dict[str, Any] = {"type": kind, key: url}
        if kind == "input_image":
            part["detail"] = detail or "auto"
        marker = breakpoint_marker(raw, path)
        if marker is not None:
            part["prompt_cache_breakpoint"] = marker
        return part

    def _function_call_output(self, raw: dict, path: str) -> dict:
        _check_complete_tool_item(raw, path)
        call_id = required_str(raw, "call_id", f"{path}.call_id", non_empty=True)
        output = raw.get("output")
        opath = f"{path}.output"
        if output is None:
            raise invalid(opath, f"{opath} is required", code="missing_required_parameter")
        if isinstance(output, list):
            if not output:
                raise invalid(opath, f"{opath} must be a string or a non-empty array of content parts")
            output = [self._result_part(part, f"{opath}[{i}]") for i, part in enumerate(output)]
        elif not isinstance(output, str):
            raise wrong_type(opath, "a string or an array of content parts", output)
        item: dict[str, Any] = {"type": "function_call_output", "call_id": call_id, "output": output,
                                "status": "completed"}
        for key in ("name", "namespace"):
            value = optional_str(raw, key, f"{path}.{key}")
            if value:
                item[key] = value
        return item

    def _result_part(self, raw: Any, path: str) -> dict:
        if not isinstance(raw, dict):
            raise wrong_type(path, "an object", raw)
        kind = required_str(raw, "type", f"{path}.type")
        if kind == "input_text":
            part = text_part("input_text", required_str(raw, "text", f"{path}.text"))
            marker = breakpoint_marker(raw, path)
            if marker is not None:
                part["prompt_cache_breakpoint"] = marker
            return part
        if kind == "input_image":
            return self._media(raw, kind, path)
        if kind == "input_file":
            raise cannot_provide(path, "file tool results")
        raise invalid(f"{path}.type", f"{path}.type must be input_text or input_image, got {kind!r}")


def _reasoning(raw: dict, path: str) -> dict:
    encrypted = optional_str(raw, "encrypted_content", f"{path}.encrypted_content")
    content = optional_list(raw, "content", f"{path}.content")
    if not content and encrypted is not None:
        text = open_envelope(encrypted)
        if text is not None:
            content = [{"type": "reasoning_text", "text": text}]
    if not content:
        raise cannot_provide(
            path,
            "reasoning Items without raw reasoning_text content (summaries and another server's "
            "encrypted content cannot be replayed into the prompt)",
        )
    texts = []
    for i, part in enumerate(content):
        ppath = f"{path}.content[{i}]"
        if not isinstance(part, dict):
            raise wrong_type(ppath, "an object", part)
        if part.get("type") != "reasoning_text":
            raise invalid(f"{ppath}.type", f"{ppath}.type must be reasoning_text")
        texts.append({"type": "reasoning_text", "text": required_str(part, "text", f"{ppath}.text")})
    summary = optional_list(raw, "summary", f"{path}.summary") or []
    for i, part in enumerate(summary):
        ppath = f"{path}.summary[{i}]"
        if not isinstance(part, dict) or part.get("type") != "summary_text":
            raise invalid(ppath, f"{ppath} must be a summary_text part")
        required_str(part, "text", f"{ppath}.text")
    item: dict[str, Any] = {"type": "reasoning", "summary": list(summary), "content": texts}
    if encrypted is not None:
        item["encrypted_content"] = encrypted  # opaque next to the raw text; never rendered
    status = enum_value(raw, "status", f"{path}.status", ITEM_STATUSES)
    if status is not None:
        item["status"] = status
    return item


def _function_call(raw: dict, path: str) -> dict:
    _check_complete_tool_item(raw, path)
    call_id = required_str(raw, "call_id", f"{path}.call_id", non_empty=True)
    name = required_str(raw, "name", f"{path}.name", non_empty=True)
    namespace = optional_str(raw, "namespace", f"{path}.namespace")
    arguments = required_str(raw, "arguments", f"{path}.arguments")
    try:
        json_object_text(arguments)
    except (ValueError, TypeError) as error:
        raise invalid(f"{path}.arguments", f"{path}.arguments is not a JSON object: {error}") from None
    item: dict[str, Any] = {"type": "function_call", "call_id": call_id, "name": name}
    if namespace:
        item["namespace"] = namespace
    item.update({"arguments": arguments, "status": "completed"})
    return item


def _check_complete_tool_item(raw: dict, path: str) -> None:
    status = enum_value(raw, "status", f"{path}.status", ITEM_STATUSES)
    if status in ("in_progress", "incomplete"):
        raise cannot_provide(f"{path}.status", f"{status} tool Items (only completed calls and results)")
    caller = optional_object(raw, "caller", f"{path}.caller")
    if caller is not None and caller.get("type") != "direct":
        raise cannot_provide(f"{path}.caller", "programmatic tool callers")
    if optional_bool(raw, "async", f"{path}.async"):
        raise cannot_provide(f"{path}.async", "asynchronous function calls")
