"""Deterministic instances of the OpenAPI request schemas, and objects that record what a validator reads.

`Examples(document).of(name)` walks a component schema and returns valid instances that, between
them, take every anyOf branch and enum value at least once (objects hold their required members
only; tests/server/test_openapi.py adds the optional ones one at a time). Every object it builds
is a `Recorded` dict that knows the properties its schema documents, so a validator reading a
member the schema does not name is noted in `UNDOCUMENTED_READS`.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

from jsonschema import Draft202012Validator

# A value of each JSON type, for the types a schema does not generate itself.
JSON_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
MEDIA_URL = "https://example.com/a.png"
STRINGS = ("text", MEDIA_URL, "data:image/png;base64,iVBORw0KGgo=")
# Keywords whose instances below are valid by construction (given valid members and items).
BUILT_EXACTLY = {"type", "enum", "properties", "required", "additionalProperties", "maxProperties", "propertyNames",
                 "items", "minItems", "maxItems", "contains", "minimum", "maximum", "pattern", "maxLength",
                 "contentMediaType", "contentSchema", "description"}
UNDOCUMENTED_READS: set[tuple[str, str]] = set()  # (where the object was documented, member read)


@contextlib.contextmanager
def recording(active: bool = True):
    """Note undocumented reads while a validator runs (schema checks read every branch's members)."""
    Recorded.active = active
    try:
        yield
    finally:
        Recorded.active = False


class Recorded(dict):
    """A request object that notes reads of members its schema does not document."""

    active = False  # set by recording()

    def __init__(self, items: dict, origin: str, schema: dict | None):
        super().__init__(items)
        self.origin = origin  # the schema location it was generated from
        self.schema = schema  # that schema (allOf merged); None: not documented
        properties = (schema or {}).get("properties")
        # Members a validator may read: the named ones, or any where the schema describes a map.
        map_like = properties is None or isinstance((schema or {}).get("additionalProperties"), dict)
        self.documented = None if map_like else frozenset(properties)

    def _note(self, key: Any) -> None:
        if Recorded.active and self.documented is not None and key not in self.documented:
            UNDOCUMENTED_READS.add((self.origin, str(key)))

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)


def clone(value: Any) -> Any:
    """A deep copy that keeps Recorded objects recording."""
    if isinstance(value, Recorded):
        return Recorded({key: clone(item) for key, item in dict.items(value)}, value.origin, value.schema)
    if isinstance(value, dict):
        return {key: clone(item) for key, item in value.items()}
    if isinstance(value, list):
        return [clone(item) for item in value]
    return value


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def generic(kind: str) -> Any:
    """A plain value of a JSON type (objects record nothing: no schema documents them)."""
    return {"null": None, "boolean": True, "integer": 7, "number": 0.5, "string": "text", "array": [],
            "object": Recorded({}, "generic", None)}[kind]


def objects(value: Any, path: tuple = ()):
    """(path, object) for every Recorded object in a body, outermost first."""
    if isinstance(value, Recorded):
        yield path, value
    if isinstance(value, dict):
        for key, item in dict.items(value):
            yield from objects(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from objects(item, (*path, i))


def replaced(body: Any, path: tuple, key: str, value: Any) -> Any:
    """A copy of body whose object at path has member key set to value."""
    body = clone(body)
    node = body
    for step in path:
        node = node[step]
    node[key] = clone(value)
    return body


class Examples:
    def __init__(self, document: dict):
        self.components = document["components"]
        self._cache: dict[str, list] = {}

    def validator(self, schema: dict) -> Draft202012Validator:
        return Draft202012Validator({**schema, "components": self.components})

    def resolve(self, schema: dict) -> dict:
        while "$ref" in schema:
            schema = self.components["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        return schema

    def merged(self, schema: dict) -> dict:
        """allOf folded into one schema (properties and required joined); $ref resolved."""
        schema = self.resolve(schema)
        if "allOf" not in schema:
            return schema
        merged = {key: value for key, value in schema.items() if key != "allOf"}
        for part in schema["allOf"]:
            part = self.merged(part)
            for key, value in part.items():
                if key == "properties":
                    known = merged.setdefault("properties", {})
                    merged["properties"] = {**known, **{name: {"allOf": [known[name], member]} if name in known
                                                         else member for name, member in value.items()}}
                elif key == "required":
                    merged["required"] = [*merged.get("required", []), *value]
                else:
                    merged.setdefault(key, value)
        return merged

    def of(self, name: str) -> list:
        if name not in self._cache:
            self._cache[name] = []  # a recursive reference generates nothing further
            self._cache[name] = self.instances(self.components["schemas"][name], name)
        return self._cache[name]

    def instances(self, schema: dict, origin: str) -> list:
        """Valid instances of `schema`, every anyOf branch and enum value among them."""
        if "$ref" in schema and set(schema) <= {"$ref", "description"}:
            return [clone(value) for value in self.of(schema["$ref"].rsplit("/", 1)[1])]
        candidates = self._candidates(self.merged(schema), origin)
        keywords = set(self.resolve(schema))
        if keywords <= BUILT_EXACTLY or keywords <= {"anyOf", "description"}:
            return candidates
        check = self.validator(schema)  # merged, negated or untyped: the candidates are checked whole
        return [value for value in candidates if check.is_valid(value)]

    def _candidates(self, schema: dict, origin: str) -> list:
        if "anyOf" in schema:
            base = {key: value for key, value in schema.items() if key != "anyOf"}
            return [value for i, branch in enumerate(schema["anyOf"])
                    for value in self.instances({"allOf": [base, branch]} if base else branch, f"{origin}.{i}")]
        if "enum" in schema:
            return [clone(value) for value in schema["enum"]]
        kinds = schema.get("type")
        if kinds is None:
            kinds = "object" if "properties" in schema else None
        if kinds is None:  # no type stated (a `not`, a bare description): one plain value of each type
            return [generic(kind) for kind in JSON_TYPES]
        if isinstance(kinds, list):
            return [value for kind in kinds for value in self._typed({**schema, "type": kind}, origin)]
        return self._typed(schema, origin)

    def _typed(self, schema: dict, origin: str) -> list:
        kind = schema["type"]
        if kind == "null":
            return [None]
        if kind == "boolean":
            return [False, True]
        if kind in ("integer", "number"):
            low, high = schema.get("minimum", 0), schema.get("maximum")
            values = [low] if high is None or high >= low else []
            values += [high] if high is not None and high != low else []
            if kind == "number":
                values.append(low + 0.5 if high is None or low + 0.5 <= high else (low + high) / 2)
            return values
        if kind == "string":
            pattern = schema.get("pattern")
            return [value for value in STRINGS if pattern is None or re.search(pattern, value)][:1] or ["text"]
        if kind == "array":
            if schema.get("maxItems") == 0:
                return [[]]
            # Items of any shape (no `items`): strings will do.
            items = self.instances(schema.get("items", {"type": "string"}), f"{origin}[]")
            if "contains" in schema:  # the item it must contain first, then each other item
                wanted = self.instances(schema["contains"], f"{origin}[]")[:1]
                return [[*map(clone, wanted), item] for item in items] if wanted else []
            lists = [[item] for item in items]
            return lists if schema.get("minItems", 0) else [[], *lists]
        return self._objects(schema, origin)

    def _objects(self, schema: dict, origin: str) -> list:
        properties = schema.get("properties", {})
        members = {key: self.instances(properties[key], f"{origin}.{key}") for key in schema.get("required", [])}
        if any(not values for values in members.values()):
            return []
        count = max((len(values) for values in members.values()), default=1)
        return [Recorded({key: clone(values[i % len(values)]) for key, values in members.items()}, origin, schema)
                for i in range(count)]
