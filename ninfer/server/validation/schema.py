"""JSON Schema pieces for the OpenAPI document, shared by the request definitions of every protocol.

A schema describes what is *accepted*: an option that is only ever refused appears as its one
neutral value, with the refusal in its description (`unprovidable`).
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

NULL: Schema = {"type": "null"}
STRING: Schema = {"type": "string"}
NON_EMPTY_STRING: Schema = {"type": "string", "minLength": 1}
BOOLEAN: Schema = {"type": "boolean"}
OBJECT: Schema = {"type": "object"}
NO_ITEMS: Schema = {"type": "array", "maxItems": 0}
# A recognised option that is served only while it asks for nothing: null, [] or {}.
EMPTY: Schema = {"anyOf": [NULL, NO_ITEMS, {"type": "object", "maxProperties": 0}]}


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def described(schema: Schema, description: str | None) -> Schema:
    return {**schema, "description": description} if description else schema


def nullable(schema: Schema) -> Schema:
    """Explicit null means "not given" in every validator."""
    return {"anyOf": [schema, NULL]}


def const(value: Any, description: str | None = None) -> Schema:
    return described({"enum": [value]}, description)


def enum(values: tuple | list, description: str | None = None) -> Schema:
    return described({"type": "string", "enum": list(values)}, description)


def number(low: float, high: float) -> Schema:
    return {"type": "number", "minimum": low, "maximum": high}


def integer(low: int, high: int | None = None) -> Schema:
    schema: Schema = {"type": "integer", "minimum": low}
    if high is not None:
        schema["maximum"] = high
    return schema


def obj(properties: dict[str, Schema], required: tuple[str, ...] = (), *, closed: bool = False, **extra) -> Schema:
    """An object; optional members accept null (validators read null as absent) unless already typed so."""
    schema: Schema = {
        "type": "object",
        "properties": {
            key: value if key in required or _admits_null(value) else nullable(value) for key, value in properties.items()
        },
    }
    if required:
        schema["required"] = list(required)
    if closed:
        schema["additionalProperties"] = False
    schema.update(extra)
    return schema


def _admits_null(schema: Schema) -> bool:
    if schema.get("type") == "null" or None in schema.get("enum", ()):
        return True
    return any(_admits_null(option) for option in schema.get("anyOf", ()))


def unprovidable(neutral: Schema, refusal: str) -> Schema:
    """An option whose only accepted value is its neutral one; anything else is unsupported_parameter."""
    return {**neutral, "description": f"{refusal} (400 unsupported_parameter otherwise)"}
