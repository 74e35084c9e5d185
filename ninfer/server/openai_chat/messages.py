"""Chat Completions messages -> Conversation messages: roles, content parts, tool-call history.

Adjacent text parts stay separate parts (the builder joins them without separators); a
replayed refusal is what the assistant said; legacy `function` results pair with the
preceding assistant function_call, whose derived id keeps replays rendering identically.
"""

from __future__ import annotations

from typing import Any

from ninfer.frontend.conversation import Message, Part, TextPart, ToolCall
from ninfer.server.errors import invalid
from ninfer.server.validation.cache_markers import breakpoint_marker
from ninfer.server.validation.fields import (
    arguments_field,
    cannot_provide,
    optional_list,
    optional_object,
    optional_str,
    required_list,
    required_str,
    wrong_type,
)
from ninfer.server.validation.media import check_detail, media_part

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
ASSISTANT_ONLY_FIELDS = ("reasoning_content", "reasoning", "tool_calls", "function_call", "refusal", "audio")
MEDIA_PART_KINDS = {"image_url": "image", "video_url": "video"}


def parse_messages(body: dict, vision_enabled: bool) -> tuple[list[Message], list[TextPart]]:
    """The conversation's messages and the text parts that carry an explicit cache breakpoint."""
    raw = required_list(body, "messages", "messages")
    parser = _MessageParser(vision_enabled)
    messages = [parser.parse(item, f"messages[{i}]") for i, item in enumerate(raw)]
    return messages, parser.breakpoints


class _MessageParser:
    """Parses messages in order; remembers legacy function calls so results can be paired."""

    def __init__(self, vision_enabled: bool):
        self.vision_enabled = vision_enabled
        self.messages: list[Message] = []
        self.legacy_calls: dict[int, ToolCall] = {}  # message index -> its legacy function_call
        self.breakpoints: list[TextPart] = []

    def parse(self, raw: Any, path: str) -> Message:
        if not isinstance(raw, dict):
            raise wrong_type(path, "an object", raw)
        role = required_str(raw, "role", f"{path}.role")
        if role not in ROLES:
            raise invalid(f"{path}.role", f"{path}.role must be one of {', '.join(ROLES)}, got {role!r}")
        if role != "assistant":
            self._reject_assistant_fields(raw, path)
        if role == "function":
            message = self._function_result(raw, path)
        else:
            self._check_name(raw, role, path)
            if role == "assistant":
                message = self._assistant(raw, path)
            else:
                message = Message(role=role, content=self._content(raw, role, path))
                if role == "tool":
                    message.tool_call_id = required_str(raw, "tool_call_id", f"{path}.tool_call_id", non_empty=True)
        self.messages.append(message)
        return message

    @staticmethod
    def _reject_assistant_fields(raw: dict, path: str) -> None:
        # Dropping them would silently lose prompt content, so they are errors rather than unknown fields.
        for key in ASSISTANT_ONLY_FIELDS:
            if raw.get(key) not in (None, []):
                raise invalid(f"{path}.{key}", f"{path}.{key}: only assistant messages carry {key}")

    @staticmethod
    def _check_name(raw: dict, role: str, path: str) -> None:
        name = raw.get("name")
        if name is None:
            return
        if not isinstance(name, str):
            raise wrong_type(f"{path}.name", "a string", name)
        # Tool results may mirror the function name (ignored); other roles would need participant identity.
        if name and role != "tool":
            raise cannot_provide(f"{path}.name", "participant names (the chat template cannot represent them)")

    def _assistant(self, raw: dict, path: str) -> Message:
        if raw.get("audio") is not None:
            raise cannot_provide(f"{path}.audio", "audio output history")
        content = self._content(raw, "assistant", path, nullable=True)
        refusal = optional_str(raw, "refusal", f"{path}.refusal")
        if refusal:
            content.append(TextPart(refusal))  # a replayed refusal is what the assistant said
        message = Message(role="assistant", content=content, reasoning=self._reasoning(raw, path))
        tool_calls = optional_list(raw, "tool_calls", f"{path}.tool_calls") or []
        message.tool_calls = [self._tool_call(call, f"{path}.tool_calls[{i}]") for i, call in enumerate(tool_calls)]
        function_call = optional_object(raw, "function_call", f"{path}.function_call")
        if function_call is not None:
            if message.tool_calls:
                raise invalid(f"{path}.function_call", f"{path}: give either tool_calls or function_call, not both")
            # Legacy calls carry no id; derive one from the position so replays render identically.
            call = ToolCall(
                name=required_str(function_call, "name", f"{path}.function_call.name", non_empty=True),
                arguments=arguments_field(function_call, "arguments", f"{path}.function_call.arguments"),
                call_id=f"call_legacy_{len(self.messages)}",
            )
            message.tool_calls = [call]
            self.legacy_calls[len(self.messages)] = call
        return message

    @staticmethod
    def _reasoning(raw: dict, path: str) -> str | None:
        content = optional_str(raw, "reasoning_content", f"{path}.reasoning_content")
        alias = optional_str(raw, "reasoning", f"{path}.reasoning")
        if content is not None and alias is not None and content != alias:
            raise invalid(f"{path}.reasoning", f"{path}: reasoning and reasoning_content are aliases but differ")
        return content if content is not None else alias

    @staticmethod
    def _tool_call(raw: Any, path: str) -> ToolCall:
        if not isinstance(raw, dict):
            raise wrong_type(path, "an object", raw)
        kind = optional_str(raw, "type", f"{path}.type")
        if kind not in (None, "function"):
            if kind == "custom":
                raise cannot_provide(f"{path}.type", "custom tool calls")
            raise invalid(f"{path}.type", f"{path}.type must be function, got {kind!r}")
        call_id = optional_str(raw, "id", f"{path}.id")
        function = raw.get("function")
        if not isinstance(function, dict):
            raise wrong_type(f"{path}.function", "an object", function)
        name = required_str(function, "name", f"{path}.function.name", non_empty=True)
        arguments = arguments_field(function, "arguments", f"{path}.function.arguments")
        return ToolCall(name=name, arguments=arguments, call_id=call_id)

    def _function_result(self, raw: dict, path: str) -> Message:
        """Legacy role "function": a result for the preceding assistant function_call."""
        name = required_str(raw, "name", f"{path}.name", non_empty=True)
        content = raw.get("content")
        if content is not None and not isinstance(content, str):
            raise wrong_type(f"{path}.content", "a string or null", content)
        call = self._preceding_legacy_call()
        if call is None:
            raise invalid(path, f"{path}: a function result must follow an assistant message with a function_call")
        if call.name != name:
            raise invalid(
                f"{path}.name", f"{path}.name {name!r} does not match the preceding function_call {call.name!r}"
            )
        return Message(role="tool", content=[TextPart(content)] if content else [], tool_call_id=call.call_id)

    def _preceding_legacy_call(self) -> ToolCall | None:
        for index in range(len(self.messages) - 1, -1, -1):
            if self.messages[index].role != "tool":
                return self.legacy_calls.get(index)  # the nearest non-result message must hold the call
        return None

    def _content(self, raw: dict, role: str, path: str, *, nullable: bool = False) -> list[Part]:
        content = raw.get("content")
        path = f"{path}.content"
        if content is None:
            if nullable:
                return []  # an assistant turn of only tool calls or reasoning
            raise invalid(path, f"{path} is required", code="missing_required_parameter")
        if isinstance(content, str):
            return [TextPart(content)]
        if not isinstance(content, list):
            raise wrong_type(path, "a string or an array of content parts", content)
        return [self._part(part, role, f"{path}[{i}]") for i, part in enumerate(content)]

    def _part(self, raw: Any, role: str, path: str) -> Part:
        if not isinstance(raw, dict):
            raise wrong_type(path, "an object", raw)
        kind = required_str(raw, "type", f"{path}.type")
        marked = breakpoint_marker(raw, path) is not None
        if kind in ("text", "refusal"):
            if kind == "refusal" and role != "assistant":
                raise invalid(f"{path}.type", f"{path}: refusal parts belong to assistant messages")
            part = TextPart(required_str(raw, kind, f"{path}.{kind}"), cache_breakpoint=marked)
            if marked:
                self.breakpoints.append(part)
            return part
        if kind in MEDIA_PART_KINDS:
            if role not in ("user", "tool"):
                raise invalid(f"{path}.type", f"{path}: {kind} parts belong to user or tool messages")
            return self._media(raw, kind, path, marked)
        if kind == "input_audio":
            raise cannot_provide(path, "audio input")
        if kind == "file":
            raise cannot_provide(path, "file input")
        raise invalid(f"{path}.type", f"{path}.type {kind!r} is not a known content part type")

    def _media(self, raw: dict, kind: str, path: str, marked: bool) -> Part:
        source = raw.get(kind)
        source_path = f"{path}.{kind}"
        if isinstance(source, str):
            url = source  # string-form URL: a widely generated compatible shape
        elif isinstance(source, dict):
            url = required_str(source, "url", f"{source_path}.url")
            check_detail(optional_str(source, "detail", f"{source_path}.detail"), f"{source_path}.detail")
            source_path = f"{source_path}.url"
        else:
            raise wrong_type(source_path, "a URL string or an object with url", source)
        return media_part(MEDIA_PART_KINDS[kind], url, path, source_path, self.vision_enabled, marked)
