"""Sampling and stop fields with OpenAI's ranges (Chat, Responses); Messages narrows them itself."""

from __future__ import annotations

from ninfer.contract.sampling import TOP_K_CAP, SamplingOverrides
from ninfer.server.errors import invalid
from ninfer.server.validation.fields import optional_int, optional_list, optional_number, wrong_type

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def openai_sampling(body: dict) -> SamplingOverrides:
    return SamplingOverrides(
        temperature=optional_number(body, "temperature", 0, 2),
        top_p=optional_number(body, "top_p", 0, 1),
        top_k=optional_int(body, "top_k", 0, TOP_K_CAP),
        min_p=optional_number(body, "min_p", 0, 1),
        presence_penalty=optional_number(body, "presence_penalty", -2, 2),
        frequency_penalty=optional_number(body, "frequency_penalty", -2, 2),
        seed=optional_int(body, "seed", SEED_MIN, SEED_MAX),
    )


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
