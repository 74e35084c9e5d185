"""PromptBuilder: Conversation -> the artifact's chat template -> token ids + cache hints.

Also computes the capture hints the engine snapshots while prefilling:
- the turn-closure frontier: the token offset just before the first assistant opener of the
  open turn, or before the generation prologue when closed-turn reasoning is preserved, so
  the next turn can reuse the stable conversation even when its re-render of this turn differs;
- the cache breakpoints the request marks (shared stable prefixes);
- long anchors in long prompts: message starts late in the prompt, so a request that diverges
  there (an edited last message, a retried or undone turn) still reuses most of the prefix.
"""

from __future__ import annotations

import copy
import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any

from ninfer.contract.media import MediaInput
from ninfer.contract.request import CaptureHint
from ninfer.contract.reuse_path import ReusePath
from ninfer.frontend.capabilities import TemplateCapabilities
from ninfer.frontend.conversation import Conversation, MediaPart, Message, TextPart
from ninfer.frontend.prompt_encoder import EncodedPrompt, PromptEncoder
from ninfer.frontend.template import ChatTemplate, TemplateError
from ninfer.frontend.tokenizer import Tokenizer
from ninfer.frontend.tokenizer_clock import TokenizerClock

# Private-use characters: a marker no template or tokenizer treats specially.
_SENTINEL = "\ue000NINFER-CACHE-BREAKPOINT\ue001"
# Long anchors only in prompts at least this long, each at least ANCHOR_MIN_GAP tokens from
# every other capture frontier: a snapshot that saves less than that is not worth its slot.
LONG_PROMPT_TOKENS = 4096
ANCHOR_MIN_GAP = 1024


class PromptError(ValueError):
    """The conversation cannot be rendered by the loaded template (HTTP 400 invalid_prompt)."""


@dataclass(frozen=True)
class PreparedPrompt:
    token_ids: list[int]
    thinking: bool  # the prompt leaves a think block open: output starts in the reasoning channel
    capture_hints: list[CaptureHint]
    enable_thinking: bool | None  # the value given to the template (None: it has no switch)
    preserve_thinking: bool | None
    media: list[MediaInput] = field(default_factory=list)  # prepared items, once expanded (media_expansion.py)
    media_stats: dict[str, int | float] = field(default_factory=dict)  # how they were prepared (request log)
    tokenizer_seconds: float = 0.0  # encoding this prompt and its frontier prefixes (request log)
    tokenizer_calls: int = 0


class PromptBuilder:
    def __init__(
        self,
        template: ChatTemplate,
        tokenizer: Tokenizer,
        capabilities: TemplateCapabilities,
        *,
        default_thinking: bool = True,
        default_preserve_thinking: bool = False,
        max_long_anchors: int = 2,
    ):
        self.template = template
        self.tokenizer = tokenizer
        self.capabilities = capabilities
        self.default_thinking = default_thinking
        self.default_preserve_thinking = default_preserve_thinking
        self.max_long_anchors = max_long_anchors
        self.encoder = PromptEncoder(tokenizer)
        self.message_start_id = self._message_start_id()

    # ---- public ----------------------------------------------------------------------
    def build(self, conversation: Conversation, with_capture_hints: bool = True) -> PreparedPrompt:
        with TokenizerClock().measuring() as clock:
            prepared = self._build(conversation, with_capture_hints)
        return dataclasses.replace(prepared, tokenizer_seconds=clock.encode_seconds, tokenizer_calls=clock.encode_calls)

    def _build(self, conversation: Conversation, with_capture_hints: bool) -> PreparedPrompt:
        kwargs = self.template_kwargs(conversation)
        messages = conversation.messages
        text = self._render(messages, conversation, kwargs, add_generation_prompt=not conversation.continue_final_message)
        prompt = self.encoder.encode(text)
        token_ids = prompt.token_ids
        thinking = not conversation.continue_final_message and self._opens_thinking(text)
        hints: list[CaptureHint] = []
        if with_capture_hints:
            for frontier, implicit in self._breakpoint_frontiers(conversation, kwargs, prompt):
                hints.append(CaptureHint(frontier, ReusePath.SHARED_STABLE_PREFIX, implicit=implicit))
        if with_capture_hints and not conversation.continue_final_message:
            frontier = self._turn_closure_frontier(conversation, kwargs, prompt)
            if frontier is not None and all(h.frontier != frontier for h in hints):
                hints.append(CaptureHint(frontier, ReusePath.PRIVATE_TURN_CLOSURE))
        if with_capture_hints:
            taken = [h.frontier for h in hints]
            hints += [CaptureHint(f, ReusePath.PRIVATE_LONG_ANCHOR) for f in self._long_anchors(token_ids, taken)]
        return PreparedPrompt(
            token_ids=token_ids,
            thinking=thinking,
            capture_hints=hints,
            enable_thinking=kwargs.get("enable_thinking"),
            preserve_thinking=kwargs.get("preserve_thinking"),
        )

    def template_kwargs(self, conversation: Conversation) -> dict[str, Any]:
        caps = self.capabilities
        kwargs: dict[str, Any] = {}
        if caps.supports_thinking_switch:
            kwargs["enable_thinking"] = (
                self.default_thinking if conversation.enable_thinking is None else conversation.enable_thinking
            )
        if conversation.reasoning_effort is not None and caps.effort_tiers:
            kwargs["reasoning_effort"] = conversation.reasoning_effort
        if caps.supports_preserve_thinking:
            preserve = conversation.preserve_thinking
            kwargs["preserve_thinking"] = self.default_preserve_thinking if preserve is None else preserve
        return kwargs

    # ---- rendering -------------------------------------------------------------------
    def _render(
        self, messages: list[Message], conversation: Conversation, kwargs: dict[str, Any], add_generation_prompt: bool
    ) -> str:
        template_messages = [self._template_message(m) for m in messages]
        tools = [self._template_tool(t) for t in conversation.tools] or None
        try:
            text = self.template.render(template_messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        except TemplateError as error:
            lowered = self._render_with_inline_system(template_messages, tools, add_generation_prompt, kwargs)
            if lowered is None:
                raise PromptError(f"the model's chat template rejected the conversation: {error}") from error
            text = lowered
        if conversation.continue_final_message:
            text = self._cut_after_final_message(text, messages[-1])
        return text

    def _render_with_inline_system(
        self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool, kwargs: dict
    ) -> str | None:
        """Templates that only allow a leading system turn (Qwen3.5) still get mid-conversation
        system messages at their positions: render them as sentinel user turns, then relabel
        those ChatML blocks as system blocks."""
        inline = [i for i, m in enumerate(messages) if m["role"] == "system" and i > 0]
        if not inline:
            return None
        sentinels = {}
        patched = list(messages)
        for i in inline:
            sentinel = f"NINFER-SYSTEM-{uuid.uuid4().hex}"
            sentinels[sentinel] = messages[i]["content"]
            patched[i] = {"role": "user", "content": sentinel}
        try:
            text = self.template.render(patched, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        except TemplateError:
            return None
        for sentinel, content in sentinels.items():
            block = f"<|im_start|>user\n{sentinel}<|im_end|>"
            if text.count(block) != 1 or not isinstance(content, str):
                return None
            text = text.replace(block, f"<|im_start|>system\n{content}<|im_end|>")
        return text

    @staticmethod
    def _cut_after_final_message(text: str, final: Message) -> str:
        """Continue a prefilled assistant message: drop what the template appends after its text."""
        final_text = final.text
        end = text.rfind(final_text) if final_text else -1
        if end < 0:
            raise PromptError("the assistant prefill does not appear in the rendered prompt")
        return text[: end + len(final_text)]

    @staticmethod
    def _template_message(message: Message) -> dict[str, Any]:
        role = "system" if message.role == "developer" else message.role
        out: dict[str, Any] = {"role": role}
        if message.has_media:
            parts = []
            for part in message.content:
                if isinstance(part, TextPart):
                    parts.append({"type": "text", "text": part.text})
                elif isinstance(part, MediaPart):
                    parts.append({"type": part.kind})
            out["content"] = parts
        else:
            out["content"] = message.text
        if message.reasoning is not None:
            out["reasoning_content"] = message.reasoning
        if message.tool_calls:
            out["tool_calls"] = [
                {
                    "type": "function",
                    **({"id": c.call_id} if c.call_id else {}),
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in message.tool_calls
            ]
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        return out

    @staticmethod
    def _template_tool(tool) -> dict[str, Any]:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.parameters is not None:
            function["parameters"] = tool.parameters
        return {"type": "function", "function": function}

    def _opens_thinking(self, text: str) -> bool:
        caps = self.capabilities
        if not caps.supports_thinking:
            return False
        tail = text.rstrip()
        return tail.endswith(caps.think_open)

    def _prefix_frontier(self, prompt: EncodedPrompt, prefix: str) -> int | None:
        """The token count of `prefix` inside the prompt, when the prompt's first tokens are exactly
        its tokens. Prefixes ending where a special token starts (message boundaries) are read
        off the prompt's own encoding; any other prefix is encoded and compared."""
        token_ids = prompt.token_ids
        if not prompt.text.startswith(prefix):
            return None
        frontier = prompt.split_points.get(len(prefix))
        if frontier is None:
            prefix_ids = self.tokenizer.encode(prefix)
            frontier = len(prefix_ids) if token_ids[: len(prefix_ids)] == prefix_ids else None
        return frontier if frontier is not None and 0 < frontier < len(token_ids) else None

    def _breakpoint_frontiers(
        self, conversation: Conversation, kwargs: dict[str, Any], prompt: EncodedPrompt
    ) -> list[tuple[int, bool]]:
        """(frontier, implicit only) of the requested cache breakpoints, ascending; unrepresentable
        ones are skipped. The implicit candidate counts as explicit where an explicit one coincides.

        Each is found by rendering with a sentinel at the breakpoint: the text before it must be a
        prefix of the real prompt and must tokenize to a prefix of its token ids (_prefix_frontier).
        """
        targets: list[tuple[str, int, int, bool]] = []
        for i, message in enumerate(conversation.messages):
            for j, part in enumerate(message.content):
                if part.cache_breakpoint:
                    targets.append(("part" if isinstance(part, TextPart) else "media", i, j, False))
        for t, tool in enumerate(conversation.tools):
            if tool.cache_breakpoint and tool.description:
                targets.append(("tool", t, 0, False))
        if conversation.implicit_cache_breakpoint and conversation.messages:
            last = len(conversation.messages) - 1
            texts = [j for j, p in enumerate(conversation.messages[last].content) if isinstance(p, TextPart)]
            if texts:
                targets.append(("part", last, texts[-1], True))
        frontiers: dict[int, bool] = {}
        for kind, index, part_index, implicit in targets:
            marked = copy.deepcopy(conversation)
            if kind == "part":
                part = marked.messages[index].content[part_index]
                part.text += _SENTINEL
            elif kind == "media":
                # After the item's placeholder: MediaExpansion moves the frontier past its tokens.
                marked.messages[index].content.insert(part_index + 1, TextPart(_SENTINEL))
            else:
                marked.tools[index].description += _SENTINEL
            try:
                rendered = self._render(
                    marked.messages, marked, kwargs, add_generation_prompt=not conversation.continue_final_message
                )
            except PromptError:
                continue
            offset = rendered.find(_SENTINEL)
            if offset < 0 or rendered.count(_SENTINEL) != 1:
                continue
            frontier = self._prefix_frontier(prompt, rendered[:offset])
            if frontier is not None:
                frontiers[frontier] = frontiers.get(frontier, True) and implicit
        return sorted(frontiers.items())

    def _message_start_id(self) -> int | None:
        """The special token that opens every message (ChatML's <|im_start|>, Llama 3's
        <|start_header_id|>): the first token an appended assistant message adds."""
        one = [{"role": "user", "content": "x"}]
        two = [*one, {"role": "assistant", "content": "y"}]
        try:
            short = self.template.render(one, add_generation_prompt=False)
            longer = self.template.render(two, add_generation_prompt=False)
        except TemplateError:
            return None
        if not longer.startswith(short):
            return None
        short_ids, longer_ids = self.tokenizer.encode(short), self.tokenizer.encode(longer)
        if longer_ids[: len(short_ids)] != short_ids or len(longer_ids) == len(short_ids):
            return None
        opener = longer_ids[len(short_ids)]
        return opener if opener in self.tokenizer.special_token_ids else None

    def _long_anchors(self, token_ids: list[int], taken: list[int]) -> list[int]:
        """Up to max_long_anchors message starts, latest first, before the prompt's last one (the
        generation opener). A request diverging inside the message after an anchor resumes from
        the nearest frontier before its divergence, so an anchor must sit ANCHOR_MIN_GAP past
        every earlier hint and apart from the other anchors. A special token always starts a
        token of its own: a later prompt with the same text up to there has exactly these tokens."""
        if self.message_start_id is None or self.max_long_anchors <= 0 or len(token_ids) < LONG_PROMPT_TOKENS:
            return []
        start_id = self.message_start_id
        starts = [i for i, token in enumerate(token_ids) if token == start_id and i > 0]
        anchors: list[int] = []
        for start in reversed(starts[:-1]):
            if len(anchors) == self.max_long_anchors:
                break
            earlier = max((f for f in taken if f <= start), default=0)
            if start - earlier >= ANCHOR_MIN_GAP and all(a - start >= ANCHOR_MIN_GAP for a in anchors):
                anchors.append(start)
        return sorted(anchors)

    def _turn_closure_frontier(self, conversation: Conversation, kwargs: dict[str, Any], prompt: EncodedPrompt) -> int | None:
        """Token count of the stable conversation before the open turn's first assistant opener."""
        messages = conversation.messages
        last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=None)
        if last_user is None:
            return None
        preserve = kwargs.get("preserve_thinking", False)
        cut = len(messages)
        if not preserve:
            cut = next((i for i in range(last_user + 1, len(messages)) if messages[i].role == "assistant"), cut)
        try:
            prefix = self._render(messages[:cut], conversation, kwargs, add_generation_prompt=False)
        except PromptError:
            return None
        return self._prefix_frontier(prompt, prefix)
