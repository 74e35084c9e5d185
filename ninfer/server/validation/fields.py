"""Readers for JSON request fields: type checks with field-path errors, shared by every protocol parser."""

from __future__ import annotations

import json
import math
from typing import Any

from ninfer.server.errors import APIError, invalid, unsupported


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


def optional_number(obj: dict, key: str, low: float, high: float) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if not is_number(value):
        raise wrong_type(key, "a number", value)
    if not math.isfinite(value) or not low <= value <= high:
        raise invalid(key, f"{key} must be a finite number between {low:g} and {high:g}, got {value!r}")
    return float(value)


def optional_int(obj: dict, key: str, low: int, high: int | None = None) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if not is_int(value):
        raise wrong_type(key, "an integer", value)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise invalid(key, f"{key} must be an integer {bound}, got {value}")
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
