"""Readers for JSON request fields: type checks with field-path errors, shared by every protocol parser.

`Fields` declares the members of one request object once: each member's JSON Schema for the
OpenAPI document and, for a plain value (a boolean, a string, a number in a range, one of a few
strings), the reader the validator takes it with, so the two cannot disagree.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ninfer.server.errors import APIError, invalid, unsupported
from ninfer.server.validation.schema import BOOLEAN, STRING, Schema, described, enum, integer, number, obj, unprovidable


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def cannot_provide(param: str, capability: str) -> APIError:
    return unsupported(param, f"NInfer cannot provide {capability}")


def wrong_type(path: str, expected: str, value: Any) -> APIError:
    return invalid(path, f"{path} must be {expected}, not {json_type(value)}", code="invalid_type")


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    """An integer literal: 4.0 is refused, as OpenAI and Anthropic refuse it (invalid_type)."""
    return isinstance(value, int) and not isinstance(value, bool)


def optional_bool(obj: dict, key: str, path: str) -> bool | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, bool):
        raise wrong_type(path, "a boolean", value)
    return value


def optional_str(obj: dict, key: str, path: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise wrong_type(path, "a string", value)
    return value


def optional_object(obj: dict, key: str, path: str) -> dict | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, dict):
        raise wrong_type(path, "an object", value)
    return value


def optional_list(obj: dict, key: str, path: str) -> list | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, list):
        raise wrong_type(path, "an array", value)
    return value


def optional_number(obj: dict, key: str, low: float, high: float, path: str | None = None) -> float | None:
    value = obj.get(key)
    path = path or key
    if value is None:
        return None
    if not is_number(value):
        raise wrong_type(path, "a number", value)
    if not math.isfinite(value) or not low <= value <= high:
        raise invalid(path, f"{path} must be a finite number between {low:g} and {high:g}, got {value!r}")
    return float(value)


def optional_int(obj: dict, key: str, low: int, high: int | None = None, path: str | None = None) -> int | None:
    value = obj.get(key)
    path = path or key
    if value is None:
        return None
    if not is_int(value):
        raise wrong_type(path, "an integer", value)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise invalid(path, f"{path} must be an integer {bound}, got {value}")
    return value


def required_str(obj: dict, key: str, path: str, *, non_empty: bool = False) -> str:
    value = obj.get(key)
    if value is None:
        raise invalid(path, f"{path} is required", code="missing_required_parameter")
    if not isinstance(value, str):
        raise wrong_type(path, "a string", value)
    if non_empty and not value:
        raise invalid(path, f"{path} must not be empty")
    return value


def enum_value(obj: dict, key: str, path: str, allowed: tuple[str, ...]) -> str | None:
    value = optional_str(obj, key, path)
    if value is not None and value not in allowed:
        raise invalid(path, f"{path} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def object_body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not {json_type(body)}", code="invalid_type")
    return body


def require_object(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise wrong_type(path, "an object", value)
    return value


def _reject_non_finite(constant: str) -> Any:
    raise ValueError(f"{constant} is not valid JSON")


def json_object_text(text: str) -> dict[str, Any]:
    """A JSON string holding an object (tool-call arguments); member order is kept because it
    reaches the prompt. Raises ValueError (bad JSON, NaN/Infinity) or TypeError (not an object)."""
    value = json.loads(text, parse_constant=_reject_non_finite)
    if not isinstance(value, dict):
        raise TypeError(f"it must encode a JSON object, not {json_type(value)}")
    return value


def arguments_field(obj: dict, key: str, path: str) -> dict[str, Any]:
    """A required field holding JSON-object text, parsed (tool-call history arguments)."""
    text = obj.get(key)
    if text is None:
        raise invalid(path, f"{path} is required", code="missing_required_parameter")
    if not isinstance(text, str):
        raise wrong_type(path, "a JSON string", text)
    try:
        return json_object_text(text)
    except (ValueError, TypeError) as error:
        raise invalid(path, f"{path} is not a JSON object: {error}") from None


def required_list(obj: dict, key: str, what: str) -> list:
    """A required, non-empty array (`what` names its items in the errors)."""
    value = obj.get(key)
    if value is None:
        raise invalid(key, f"{key} is required", code="missing_required_parameter")
    if not isinstance(value, list):
        raise wrong_type(key, f"an array of {what}", value)
    if not value:
        raise invalid(key, f"{key} must contain at least one {what.removesuffix('s')}")
    return value


Reader = Callable[[dict, str, str], Any]  # (object, member, its path in the body) -> the value, None when absent


@dataclass(frozen=True)
class Field:
    """One member of a request object: its JSON Schema and, for a plain value, its reader
    (None: a parser of its own reads it, and the drift test in tests/server/test_openapi.py holds
    the schema to it)."""

    schema: Schema
    reader: Reader | None = None

    @classmethod
    def boolean(cls, description: str | None = None) -> Field:
        return cls(described(BOOLEAN, description), optional_bool)

    @classmethod
    def string(cls, description: str | None = None) -> Field:
        return cls(described(STRING, description), optional_str)

    @classmethod
    def integer(cls, low: int, high: int | None = None, description: str | None = None) -> Field:
        return cls(described(integer(low, high), description),
                   lambda obj, key, path: optional_int(obj, key, low, high, path))

    @classmethod
    def number(cls, low: float, high: float, description: str | None = None) -> Field:
        return cls(described(number(low, high), description),
                   lambda obj, key, path: optional_number(obj, key, low, high, path))

    @classmethod
    def choice(cls, values: tuple[str, ...], description: str | None = None, *,
               served: tuple[str, ...] | None = None, refusal: str | None = None) -> Field:
        """One of `values`; where only `served` of them are, the others are refused as `refusal`."""
        schema = enum(served or values, description)
        return cls(unprovidable(schema, refusal) if refusal else schema,
                   lambda obj, key, path: enum_value(obj, key, path, values))

    @classmethod
    def object(cls, schema: Schema) -> Field:
        """An object whose members the validator reads in turn (often a Fields table's schema)."""
        return cls(schema, optional_object)

    @classmethod
    def shape(cls, schema: Schema) -> Field:
        """A member its own parser reads (messages, tools, formats...)."""
        return cls(schema)


class Fields(dict[str, Field]):
    """The members of one request object by name; `prefix` is the object's path in the body."""

    def __init__(self, members: dict[str, Field], prefix: str = ""):
        super().__init__(members)
        self.prefix = prefix

    def read(self, obj: dict, key: str, at: str | None = None) -> Any:
        """The member through its reader (a KeyError for one the table does not declare); `at`:
        the object's path where it varies (a part of the n-th message)."""
        reader = self[key].reader
        assert reader is not None, f"{key} is read by a parser of its own"
        prefix = self.prefix if at is None else at
        return reader(obj, key, f"{prefix}.{key}" if prefix else key)

    def schema(self, required: tuple[str, ...] = (), **extra) -> Schema:
        return obj({key: field.schema for key, field in self.items()}, required, **extra)

    def member(self, **extra) -> Field:
        """This table as a member of the object around it: an optional object."""
        return Field.object(self.schema(**extra))
