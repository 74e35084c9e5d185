"""Messages lowering: tools, system and message blocks -> Conversation, with cache markers.

Create and count_tokens share it, so both see the same prompt: the billing-header block is
consumed, consecutive User/Assistant turns are joined without separators, Thinking history
becomes the turn's reasoning, tool results are paired with their calls and put in call
order, a final text-only Assistant turn becomes a prefill, and cache_control markers become
cache_breakpoint flags (at most four, plus the request-level marker).

Compatibility rules for agent clients (Claude Code):
- a thinking block with empty text whose signature is an envelope NInfer issued (thinking
  with display "omitted") renders the reasoning text the envelope holds;
- a tool with defer_loading is rendered like any other tool: its definition is in the prompt
  from the start (the model may call it once discovered anyway); a tool_reference block in a
  tool result renders as the referenced tool's name on a line of its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ninfer.frontend.conversation import MediaPart, Message, TextPart, Tool, ToolCall
from ninfer.server.anthropic_messages.tool_results import Turn, pair_tool_results
from ninfer.server.errors import invalid
from ninfer.server.reasoning_envelope import open_envelope
from ninfer.server.validation.fields import (
    cannot_provide,
    optional_bool,
    optional_list,
    optional_object,
    optional_str,
    require_object,
    required_list,
    required_str,
    wrong_type,
)
from ninfer.server.validation.media import media_part
from ninfer.server.validation.tools import check_definition_flags

# Claude Code's attribution block: consumed when it is the first block of an array-form system.
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
MAX_CACHE_BREAKPOINTS = 4
CACHE_TTLS = ("5m", "1h")
# is_error has no slot in the Qwen tool-response markup, so the prompt text states it.
TOOL_ERROR_MARKER = "[is_error: true]\n"
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
ROLES = ("user", "assistant", "system")

# Recognised blocks whose executor or data source NInfer does not have.
UNSUPPORTED_BLOCKS = {
    "document": "document blocks (Documents and Files)",
    "search_result": "search result blocks",
    "container_upload": "container uploads",
    "redacted_thinking": "encrypted redacted-thinking restore",
    "server_tool_use": "Anthropic server-tool execution",
    "mcp_tool_use": "MCP tool execution",
    "mcp_tool_result": "MCP tool results",
    "web_search_tool_result": "server-tool results (web search)",
    "web_fetch_tool_result": "server-tool results (web fetch)",
    "code_execution_tool_result": "server-tool results (code execution)",
    "bash_code_execution_tool_result": "server-tool results (bash code execution)",
    "text_editor_code_execution_tool_result": "server-tool results (text editor code execution)",
    "tool_search_tool_result": "server-tool results (tool search)",
    "browser_state": "browser state blocks",
    "compaction": "server-side compaction blocks",
}


@dataclass
class _CacheSlot:
    """A block that accepts cache_control, in Anthropic's prefix order (tools, system, messages)."""

    path: str
    ttl: str | None  # the explicit marker's TTL, None when the block carries none
    mark: Callable[[], None] | None  # sets the cache_breakpoint flag; None: no prompt frontier exists
    targetable: bool = True  # a top-level block the request-level marker may land on


# The image types Anthropic accepts in base64 sources.
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


class Lowering:
    def __init__(self, vision_enabled: bool = False) -> None:
        self.slots: list[_CacheSlot] = []
        self.vision_enabled = vision_enabled  # image blocks are vision_disabled otherwise

    # -- tools ------------------------------------------------------------------------------

    def tools(self, body: dict) -> tuple[list[Tool], dict[str, dict]]:
        raw = optional_list(body, "tools", "tools") or []
        tools: list[Tool] = []
        schemas: dict[str, dict] = {}
        for i, item in enumerate(raw):
            path = f"tools[{i}]"
            item = require_object(item, path)
            tool, schema = self._tool(item, path)
            if tool.name in schemas:
                raise invalid(f"{path}.name", f"{path}.name {tool.name!r} is declared twice")
            schemas[tool.name] = schema
            tools.append(tool)
        return tools, schemas

    def _tool(self, raw: dict, path: str) -> tuple[Tool, dict]:
        kind = optional_str(raw, "type", f"{path}.type")
        if kind not in (None, "custom"):
            what = (
                f"toolsets ({kind})" if "toolset" in kind else f"Anthropic-provided tools ({kind}) and their executors"
            )
            raise cannot_provide(f"{path}.type", what)
        name = required_str(raw, "name", f"{path}.name")
        if not TOOL_NAME.match(name):
            raise invalid(f"{path}.name", f"{path}.name must match ^[a-zA-Z0-9_-]{{1,128}}$, got {name!r}")
        check_definition_flags(raw, path, allow_deferred=True)  # deferred tools render at once (docstring)
        optional_bool(raw, "eager_input_streaming", f"{path}.eager_input_streaming")  # transport hint
        schema = raw.get("input_schema")
        if schema is None:
            raise invalid(f"{path}.input_schema", f"{path}.input_schema is required", code="missing_required_parameter")
        schema = require_object(schema, f"{path}.input_schema")
        if schema.get("type", "object") != "object":
            raise invalid(f"{path}.input_schema.type", f"{path}.input_schema.type must be object")
        rendered = self._with_examples(raw, schema, path)
        tool = Tool(name=name, description=optional_str(raw, "description", f"{path}.description"), parameters=rendered)
        self._slot(raw, path, lambda: setattr(tool, "cache_breakpoint", True))
        return tool, schema

    @staticmethod
    def _with_examples(raw: dict, schema: dict, path: str) -> dict:
        """input_examples reach the model as the schema's standard `examples` keyword, after its own members."""
        examples = optional_list(raw, "input_examples", f"{path}.input_examples")
        if not examples:
            return schema
        for j, example in enumerate(examples):
            require_object(example, f"{path}.input_examples[{j}]")
        if "examples" in schema:
            raise invalid(f"{path}.input_examples", f"{path}: give input_examples or input_schema.examples, not both")
        return {**schema, "examples": examples}

    # -- system -----------------------------------------------------------------------------

    def system(self, body: dict) -> list[Message]:
        system = body.get("system")
        if system is None:
            return []
        if isinstance(system, str):
            return [Message(role="system", content=[TextPart(system)])] if system else []
        if not isinstance(system, list):
            raise wrong_type("system", "a string or an array of text blocks", system)
        blocks = list(enumerate(system))
        if blocks and _is_billing_header(blocks[0][1]):
            blocks = blocks[1:]  # consumed whole, its cache_control included (positional rule)
        parts = [self._system_text(block, f"system[{i}]") for i, block in blocks]
        return [Message(role="system", content=parts)] if parts else []

    def _system_text(self, block: Any, path: str) -> TextPart:
        block = require_object(block, path)
        kind = required_str(block, "type", f"{path}.type")
        if kind != "text":
            raise invalid(f"{path}.type", f"{path}.type must be text (system content is text), got {kind!r}")
        return self._text(block, path)

    # -- messages ---------------------------------------------------------------------------

    def messages(self, body: dict) -> tuple[list[Message], bool]:
        """The ordered history and whether its final Assistant turn is a prefill to continue."""
        raw = required_list(body, "messages", "messages")
        turns: list[Turn] = []
        for i, item in enumerate(raw):
            turn = self._turn(item, f"messages[{i}]")
            previous = turns[-1] if turns else None
            if previous is not None and turn.role != "system" and previous.role == turn.role:
                _join(previous, turn)  # Anthropic combines consecutive same-role turns
            else:
                turns.append(turn)
        prefill = False
        final = turns[-1]
        if final.role == "assistant" and final.calls:
            raise invalid(
                final.path,
                f"{final.path}: a final assistant turn with tool_use needs its tool_result "
                "blocks in a following user turn (an assistant prefill cannot contain tool calls)",
            )
        if final.role == "assistant":
            if final.thinking:
                raise cannot_provide(
                    final.path, "an assistant prefill that contains thinking (a prefill continues answer text)"
                )
            if final.parts and any(part.text for part in final.parts):
                prefill = True
            else:
                turns.pop()  # an empty final Assistant turn prefills nothing
        return pair_tool_results(turns), prefill

    def _turn(self, raw: Any, path: str) -> Turn:
        raw = require_object(raw, path)
        role = required_str(raw, "role", f"{path}.role")
        if role not in ROLES:
            raise invalid(f"{path}.role", f"{path}.role must be one of {', '.join(ROLES)}, got {role!r}")
        turn = Turn(role=role, path=path)
        content = raw.get("content")
        if content is None:
            raise invalid(f"{path}.content", f"{path}.content is required", code="missing_required_parameter")
        if isinstance(content, str):
            part = TextPart(content)
            turn.parts.append(part)
            turn.content_before_result = f"{path}.content"
            # String content is one text block: the request-level marker may land on it.
            self._slot({}, f"{path}.content", lambda: setattr(part, "cache_breakpoint", True))
            return turn
        if not isinstance(content, list):
            raise wrong_type(f"{path}.content", "a string or an array of content blocks", content)
        for j, block in enumerate(content):
            self._block(turn, block, f"{path}.content[{j}]")
        return turn

    def _block(self, turn: Turn, raw: Any, path: str) -> None:
        raw = require_object(raw, path)
        kind = required_str(raw, "type", f"{path}.type")
        role = turn.role
        if role == "system" and kind != "text":
            raise invalid(f"{path}.type", f"{path}.type must be text (system content is text), got {kind!r}")
        if kind != "tool_result" and turn.content_before_result is None:
            turn.content_before_result = path
        if kind == "text":
            turn.parts.append(self._text(raw, path))
        elif kind == "image":
            if role != "user":
                raise invalid(f"{path}.type", f"{path}: image blocks belong to user messages and tool results")
            turn.parts.append(self._image(raw, path))
        elif kind in ("thinking", "redacted_thinking", "tool_use") and role != "assistant":
            raise invalid(f"{path}.type", f"{path}: {kind} blocks belong to assistant messages")
        elif kind == "thinking":
            turn.thinking.append(self._thinking(raw, path))
        elif kind == "tool_use":
            turn.calls.append(self._tool_use(raw, path))
            turn.call_paths.append(path)
        elif kind == "tool_result":
            if role != "user":
                raise invalid(f"{path}.type", f"{path}: tool_result blocks belong to user messages")
            self._tool_result(turn, raw, path)
        elif kind in UNSUPPORTED_BLOCKS:
            raise cannot_provide(path, UNSUPPORTED_BLOCKS[kind])
        else:
            raise invalid(f"{path}.type", f"{path}.type {kind!r} is not a known content block type")

    def _text(self, raw: dict, path: str, *, targetable: bool = True) -> TextPart:
        text = required_str(raw, "text", f"{path}.text")
        if raw.get("citations"):
            raise cannot_provide(f"{path}.citations", "citations (they need document or search-result sources)")
        part = TextPart(text)
        self._slot(raw, path, lambda: setattr(part, "cache_breakpoint", True), targetable=targetable)
        return part

    def _image(self, raw: dict, path: str, *, targetable: bool = True) -> MediaPart:
        """An image block: a base64 source (one of IMAGE_MEDIA_TYPES) or a URL source."""
        source = raw.get("source")
        if source is None:
            raise invalid(f"{path}.source", f"{path}.source is required", code="missing_required_parameter")
        source = require_object(source, f"{path}.source")
        kind = required_str(source, "type", f"{path}.source.type")
        if kind == "base64":
            media_type = required_str(source, "media_type", f"{path}.source.media_type")
            if media_type not in IMAGE_MEDIA_TYPES:
                raise invalid(
                    f"{path}.source.media_type",
                    f"{path}.source.media_type must be one of {', '.join(IMAGE_MEDIA_TYPES)}, got {media_type!r}",
                )
            data = required_str(source, "data", f"{path}.source.data")
            url, url_path = f"data:{media_type};base64,{data}", f"{path}.source.data"
        elif kind == "url":
            url, url_path = required_str(source, "url", f"{path}.source.url"), f"{path}.source.url"
        elif kind == "file":
            raise cannot_provide(f"{path}.source", "file image sources (there is no file store)")
        else:
            raise invalid(f"{path}.source.type", f"{path}.source.type must be base64 or url, got {kind!r}")
        part = media_part("image", url, path, url_path, self.vision_enabled)
        self._slot(raw, path, lambda: setattr(part, "cache_breakpoint", True), targetable=targetable)
        return part

    @staticmethod
    def _thinking(raw: dict, path: str) -> str:
        if raw.get("cache_control") is not None:
            raise invalid(f"{path}.cache_control", f"{path}: thinking blocks cannot carry cache_control")
        signature = optional_str(raw, "signature", f"{path}.signature")
        text = required_str(raw, "thinking", f"{path}.thinking")
        if not text and signature:
            # Omitted-display thinking: the text travels in our envelope (another issuer's stays opaque).
            return open_envelope(signature) or ""
        return text

    def _tool_use(self, raw: dict, path: str) -> ToolCall:
        call_id = required_str(raw, "id", f"{path}.id")
        if not call_id:
            raise invalid(f"{path}.id", f"{path}.id must not be empty")
        name = required_str(raw, "name", f"{path}.name")
        if not name:
            raise invalid(f"{path}.name", f"{path}.name must not be empty")
        arguments = raw.get("input")
        if arguments is None:
            raise invalid(f"{path}.input", f"{path}.input is required", code="missing_required_parameter")
        arguments = require_object(arguments, f"{path}.input")
        caller = optional_object(raw, "caller", f"{path}.caller")
        if caller is not None and caller.get("type") != "direct":
            raise cannot_provide(f"{path}.caller", "programmatic tool callers (code execution)")
        if raw.get("toolset_name") is not None:
            raise cannot_provide(f"{path}.toolset_name", "toolsets")
        # A frontier inside the assistant's tool-call markup is not a rendered message boundary.
        self._slot(raw, path, None)
        return ToolCall(name=name, arguments=arguments, call_id=call_id)

    def _tool_result(self, turn: Turn, raw: dict, path: str) -> None:
        if turn.content_before_result is not None:
            raise invalid(
                path,
                f"{path}: tool_result blocks must come before other content in a user turn "
                f"({turn.content_before_result} precedes it)",
            )
        call_id = required_str(raw, "tool_use_id", f"{path}.tool_use_id")
        if raw.get("toolset_name") is not None:
            raise cannot_provide(f"{path}.toolset_name", "toolsets")
        is_error = optional_bool(raw, "is_error", f"{path}.is_error")
        parts: list[TextPart | MediaPart] = [TextPart(TOOL_ERROR_MARKER)] if is_error else []
        content = raw.get("content")
        if isinstance(content, str):
            parts.append(TextPart(content))
        elif isinstance(content, list):
            for j, block in enumerate(content):
                block_path = f"{path}.content[{j}]"
                block = require_object(block, block_path)
                kind = required_str(block, "type", f"{block_path}.type")
                if kind == "text":
                    parts.append(self._text(block, block_path, targetable=False))
                elif kind == "image":
                    parts.append(self._image(block, block_path, targetable=False))
                elif kind == "tool_reference":
                    parts.append(TextPart(required_str(block, "tool_name", f"{block_path}.tool_name") + "\n"))
                elif kind in UNSUPPORTED_BLOCKS:
                    raise cannot_provide(block_path, UNSUPPORTED_BLOCKS[kind])
                else:
                    raise invalid(
                        f"{block_path}.type", f"{block_path}.type must be text, image or tool_reference, got {kind!r}"
                    )
        elif content is not None:
            raise wrong_type(f"{path}.content", "a string or an array of content blocks", content)
        message = Message(role="tool", content=parts, tool_call_id=call_id)

        def mark() -> None:
            # The result's frontier is the end of its rendered text; an empty part marks an empty result.
            if not message.content:
                message.content.append(TextPart(""))
            message.content[-1].cache_breakpoint = True

        self._slot(raw, path, mark)
        turn.results.append((call_id, message, path))

    def _slot(self, raw: dict, path: str, mark: Callable[[], None] | None, *, targetable: bool = True) -> None:
        marker = raw.get("cache_control")
        ttl = None
        if marker is not None:
            marker = require_object(marker, f"{path}.cache_control")
            if marker.get("type") != "ephemeral":
                raise invalid(f"{path}.cache_control.type", f"{path}.cache_control.type must be ephemeral")
            ttl = _cache_ttl(marker, f"{path}.cache_control.ttl")
        self.slots.append(_CacheSlot(path, ttl, mark, targetable))

    # -- cache markers ----------------------------------------------------------------------

    def apply_cache_markers(self, body: dict) -> None:
        """Block markers (at most four) plus the request-level marker on the last cacheable block."""
        explicit = [slot for slot in self.slots if slot.ttl is not None]
        if len(explicit) > MAX_CACHE_BREAKPOINTS:
            raise invalid(
                "cache_control",
                f"at most {MAX_CACHE_BREAKPOINTS} blocks may carry cache_control; found {len(explicit)}",
            )
        marker = optional_object(body, "cache_control", "cache_control")
        if marker is not None:
            if marker.get("type") != "ephemeral":
                raise invalid("cache_control.type", "cache_control.type must be ephemeral")
            ttl = _cache_ttl(marker, "cache_control.ttl")
            target = next((slot for slot in reversed(self.slots) if slot.targetable), None)
            if target is not None and target.ttl != ttl:
                if target.ttl is not None:
                    raise invalid(
                        "cache_control",
                        f"cache_control (ttl {ttl}) targets {target.path}, which already "
                        f"carries a cache_control with ttl {target.ttl}",
                    )
                if len(explicit) >= MAX_CACHE_BREAKPOINTS:
                    raise invalid(
                        "cache_control",
                        f"cache_control needs a fifth breakpoint slot: {target.path} is not "
                        f"one of the {len(explicit)} block-level breakpoints",
                    )
                target.ttl = ttl
        for slot in self.slots:
            if slot.ttl is not None and slot.mark is not None:
                slot.mark()


def _cache_ttl(marker: dict, path: str) -> str:
    ttl = marker.get("ttl")
    if ttl is None:
        return "5m"
    if ttl not in CACHE_TTLS:
        raise invalid(path, f"{path} must be 5m or 1h, got {ttl!r}")
    return ttl


def _is_billing_header(block: Any) -> bool:
    return (
        isinstance(block, dict)
        and block.get("type") == "text"
        and isinstance(block.get("text"), str)
        and block["text"].startswith(BILLING_HEADER_PREFIX)
    )


def _join(previous: Turn, turn: Turn) -> None:
    """Append a consecutive same-role turn: blocks are concatenated without separators."""
    if turn.results and previous.content_before_result is not None:
        _, _, path = turn.results[0]
        raise invalid(path, f"{path}: tool_result blocks must come before other content in the joined user turn")
    if previous.content_before_result is None:
        previous.content_before_result = turn.content_before_result
    previous.parts += turn.parts
    previous.thinking += turn.thinking
    previous.calls += turn.calls
    previous.call_paths += turn.call_paths
    previous.results += turn.results
