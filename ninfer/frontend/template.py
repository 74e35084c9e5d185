"""ChatTemplate: renders an artifact's Jinja chat template exactly as transformers does.

Artifacts ship templates written for `transformers.apply_chat_template`, so the environment
mirrors its one: an immutable sandbox with trim_blocks / lstrip_blocks, loop controls, a
`tojson` that keeps non-ASCII text and dict member order, `raise_exception`, `strftime_now`,
the `{% generation %}` tag (rendered as its body), the tokenizer's special tokens as
variables, and `documents=None`. Anything a render raises surfaces as `TemplateError`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from ninfer.frontend.tokenizer import Tokenizer


class TemplateError(ValueError):
    """A chat template failed to compile or render.

    `raised_by_template` is true when the template itself rejected the input through
    `raise_exception(...)`; the message is then the template's own text.
    """

    def __init__(self, message: str, *, raised_by_template: bool = False):
        super().__init__(message)
        self.message = message
        self.raised_by_template = raised_by_template


class _TemplateRaised(jinja2.TemplateError):
    """What `raise_exception` throws inside Jinja, told apart from Jinja's own errors."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant spans for training masks; we render the body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: plain json.dumps (Jinja's own escapes HTML and sorts keys)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    """Several components render the same artifact template: compile it once."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise TemplateError(f"chat template does not compile (line {error.lineno}): {error.message}") from error


class ChatTemplate:
    """One compiled chat template plus the tokenizer variables it sees.

    Special tokens that are unset stay undefined in the template, as in transformers
    (templates test `bos_token is defined`).
    """

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        extra_variables: Mapping[str, Any] | None = None,
    ):
        self.source = source
        self._template = _compile(source)
        named = {"bos_token": bos_token, "eos_token": eos_token, "unk_token": unk_token, "pad_token": pad_token}
        self.variables: dict[str, Any] = {name: value for name, value in named.items() if value is not None}
        self.variables.update(extra_variables or {})

    @classmethod
    def for_tokenizer(cls, source: str, tokenizer: Tokenizer) -> ChatTemplate:
        """Bind a template to a `ninfer.frontend.tokenizer.Tokenizer`'s special tokens."""
        unk = tokenizer.config.get("unk_token")
        return cls(
            source,
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
            pad_token=tokenizer.pad_token,
            unk_token=unk.get("content") if isinstance(unk, dict) else unk,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text, as `apply_chat_template(..., tokenize=False)` would return it.

        Template kwargs (enable_thinking, reasoning_effort, preserve_thinking …) override the
        special-token variables of the same name, as in transformers.
        """
        if not messages:
            raise TemplateError("cannot render an empty conversation")
        context = {
            **self.variables,
            **template_kwargs,
            "messages": messages,
            "tools": list(tools) if tools is not None else None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except _TemplateRaised as error:
            raise TemplateError(error.message or "", raised_by_template=True) from error
        except jinja2.TemplateError as error:
            raise TemplateError(f"chat template error: {error.message}") from error
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError, RecursionError) as error:
            # Input-shaped failures inside template expressions (e.g. str + None).
            raise TemplateError(f"chat template error: {type(error).__name__}: {error}") from error
