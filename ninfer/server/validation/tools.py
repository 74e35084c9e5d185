"""Tool rules the three protocols share: definition flags, the callable set, template support.

Each protocol reads its own definition shape (Chat nests a `function` object, Responses has
flat functions and namespaces, Messages has `input_schema`), then applies these rules.
"""

from __future__ import annotations

from ninfer.frontend.capabilities import TemplateCapabilities
from ninfer.frontend.conversation import Conversation
from ninfer.server.errors import APIError, invalid
from ninfer.server.validation.fields import Field, Fields, cannot_provide, optional_bool, optional_list, required_str
from ninfer.server.validation.schema import NULL, const, nullable, unprovidable

# OpenAI-hosted tools: executed by OpenAI's servers, never by the client. A request that offers
# them without forcing one is served with them left out of the prompt (and the log says so).
HOSTED_TOOL_TYPES = frozenset(
    {
        "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
        "file_search", "code_interpreter", "image_generation", "computer_use", "computer_use_preview",
        "tool_search",
    }
)  # fmt: skip


# Members of a function definition in every protocol (Chat's nested `function`, Responses' flat
# functions, Messages' tools); defer_loading is each protocol's own (only Messages serves it).
FUNCTION_FLAGS = Fields(
    {
        "strict": Field.boolean("true: calls of this tool follow its parameters schema (a grammar over the Qwen "
                                "tool-call markup)"),
        "output_schema": Field.shape(unprovidable(NULL, "function output schemas")),
        "async": Field(unprovidable(nullable(const(False)), "asynchronous function calls"), optional_bool),
        "allowed_callers": Field(
            {"type": "array", "contains": const("direct"), "description": "must include direct"}, optional_list
        ),
    }
)

def check_definition_flags(raw: dict, path: str, *, allow_deferred: bool = False) -> bool:
    """Flags no protocol can honour without an executor; returns whether the tool is deferred
    (loaded on demand), which only Messages accepts. `strict` is read by the protocols
    (structured_output.tool_strict): its calls follow the schema through a grammar."""
    FUNCTION_FLAGS.read(raw, "strict", path)
    deferred = bool(optional_bool(raw, "defer_loading", f"{path}.defer_loading"))
    if deferred and not allow_deferred:
        raise cannot_provide(f"{path}.defer_loading", "deferred tool loading (tool search)")
    if raw.get("output_schema") is not None:
        raise cannot_provide(f"{path}.output_schema", "function output schemas")
    if FUNCTION_FLAGS.read(raw, "async", path):
        raise cannot_provide(f"{path}.async", "asynchronous function calls")
    callers = FUNCTION_FLAGS.read(raw, "allowed_callers", path)
    if callers is not None and "direct" not in callers:
        raise cannot_provide(f"{path}.allowed_callers", "tools the model may not call directly")
    return deferred


def allowed_tools_mode(config: dict, path: str) -> str:
    """allowed_tools narrows the callable set: auto, or required (one of them must be called)."""
    mode = required_str(config, "mode", path)
    if mode not in ("auto", "required"):
        raise invalid(path, f"{path} must be auto or required, got {mode!r}")
    return mode


def check_template_renders_tools(conversation: Conversation, caps: TemplateCapabilities, param: str) -> None:
    """Tools or tool-call history the loaded template would silently drop: a clear 400 instead."""
    if caps.supports_tools:
        return
    has_history = any(m.tool_calls or m.role == "tool" for m in conversation.messages)
    if conversation.tools or has_history:
        what = "tool definitions" if conversation.tools else "tool-call history"
        raise APIError(
            400,
            f"{param}: the loaded model's chat template has no tool section, so it cannot render {what}",
            code="tools_not_supported",
            param=param,
        )
