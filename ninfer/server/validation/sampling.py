"""Sampling and stop fields with OpenAI's ranges (Chat, Responses); Messages narrows them itself."""

from __future__ import annotations

from ninfer.contract.sampling import TOP_K_CAP, SamplingOverrides
from ninfer.server.errors import invalid
from ninfer.server.validation.fields import Field, Fields, optional_list, wrong_type
from ninfer.server.validation.schema import NON_EMPTY_STRING

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
OPENAI_SAMPLING = Fields(
    {
        "temperature": Field.number(0, 2),
        "top_p": Field.number(0, 1),
        "top_k": Field.integer(0, TOP_K_CAP),
        "min_p": Field.number(0, 1),
        "presence_penalty": Field.number(-2, 2),
        "frequency_penalty": Field.number(-2, 2),
        "seed": Field.integer(SEED_MIN, SEED_MAX),
    }
)


def openai_sampling(body: dict) -> SamplingOverrides:
    return SamplingOverrides(**{key: OPENAI_SAMPLING.read(body, key) for key in OPENAI_SAMPLING})


def stop_field(max_count: int | None = None, allow_string: bool = False) -> Field:
    """Non-empty stop strings: an array (at most max_count), or one string when allow_string."""
    strings = {"type": "array", "items": NON_EMPTY_STRING}
    if max_count is not None:
        strings["maxItems"] = max_count
    return Field({"anyOf": [NON_EMPTY_STRING, strings]} if allow_string else strings,
                 lambda obj, key, path: stop_strings(obj, key, max_count, allow_string))


def stop_strings(body: dict, key: str, max_count: int | None = None, allow_string: bool = False) -> list[str]:
    """Non-empty stop strings from `key` (a string when allow_string, or an array of strings)."""
    value = body.get(key)
    if value is None:
        return []
    if allow_string and isinstance(value, str):
        values, paths = [value], [key]
    else:
        values = optional_list(body, key, key) if not allow_string else value
        if not isinstance(values, list):
            raise wrong_type(key, "a string or an array of strings", value)
        if max_count is not None and len(values) > max_count:
            raise invalid(key, f"{key} accepts at most {max_count} strings, got {len(values)}")
        paths = [f"{key}[{i}]" for i in range(len(values))]
    for path, item in zip(paths, values):
        if not isinstance(item, str):
            raise wrong_type(path, "a string", item)
        if not item:
            raise invalid(path, f"{path} must be a non-empty string")
    return list(values)
