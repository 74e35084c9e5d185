"""Conversation: the protocol-neutral prompt every API adapter produces.

Chat Completions, Responses and Anthropic Messages all normalise into ordered typed
messages; the prompt builder renders them with the artifact's own chat template.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "developer", "user", "assistant", "tool"]


@dataclass
class TextPart:
    text: str
    cache_breakpoint: bool = False  # an explicit shared-prefix write candidate ends here


@dataclass
class MediaPart:
    kind: Literal["image", "video"]
    url: str  # http(s) or data: URI
    cache_breakpoint: bool = False
    path: str = field(default="", compare=False)  # the request field it came from, named by media errors


Part = TextPart | MediaPart


@dataclass
class ToolCall:
    name: str  # the tool's internal identity (namespace-qualified where the protocol has namespaces)
    arguments: dict[str, Any]  # member order as received or generated
    call_id: str | None = None


@dataclass
class Message:
    role: Role
    content: list[Part] = field(default_factory=list)
    reasoning: str | None = None  # assistant: visible reasoning of that turn
    tool_calls: list[ToolCall] = field(default_factory=list)  # assistant
    tool_call_id: str | None = None  # tool result

    @property
    def text(self) -> str:
        """Text parts joined without separators (clients rely on none being inserted)."""
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    @property
    def has_media(self) -> bool:
        return any(isinstance(p, MediaPart) for p in self.content)


@dataclass
class Tool:
    name: str  # internal identity, unique within the request
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema, member order preserved
    cache_breakpoint: bool = False  # a shared-prefix write candidate ends after this definition


@dataclass
class Conversation:
    messages: list[Message]
    tools: list[Tool] = field(default_factory=list)
    enable_thinking: bool | None = None  # None: the server/template default
    reasoning_effort: str | None = None  # a template tier, already validated
    preserve_thinking: bool | None = None  # None: the server default
    continue_final_message: bool = False  # the last assistant message is a prefill to continue
    implicit_cache_breakpoint: bool = False  # OpenAI implicit candidate: after the last content boundary

    @property
    def media_parts(self) -> list[MediaPart]:
        """Its images and videos in prompt order (the order the template renders them)."""
        return [part for message in self.messages for part in message.content if isinstance(part, MediaPart)]
