"""shared_rules: a grammar's EBNF with equal rules merged into one.

The grammar library converts every JSON schema of a structural tag into its own set of rules, so
an agent's tools carry one copy of the JSON string rules per JSON-valued parameter, and compiling
walks the whole vocabulary for each copy. Two rules whose bodies (lookahead included) are equal
once the rules they reference are merged derive the same strings, so referring to one of them
in place of the other leaves the language unchanged; merging runs to the coarsest such partition
(partition refinement, as in automaton minimization).

A text exclusion that contains another exclusion of the same rule is dropped too: whatever
contains it already contains the shorter one (the library adds a tag's end string to its
content's exclusions, and `\\n</parameter>\\n` contains `</parameter>`).
"""

from __future__ import annotations

import json
import re

# The library's printed EBNF: string literals, character classes, names, and single characters.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|::=|\s+|.', re.S)
_RULE_START = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= ")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EXCLUDES = re.compile(r'excludes=\(((?:\s*"(?:[^"\\]|\\.)*"\s*,?)*)\)')
_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_ESCAPES = re.compile(r'\\(?:[nrt"\\/]|u[0-9A-Fa-f]{4})')


def shared_rules(ebnf: str, root: str = "root") -> str:
    """`ebnf` (as the library prints a grammar, one `name ::= body` per rule) with equal rules merged
    and redundant exclusions dropped; `root` keeps its name."""
    names, bodies = _rules(ebnf)
    if root not in bodies:
        raise ValueError(f"the grammar has no rule {root!r}")
    tokens = {name: _TOKEN.findall(_without_redundant_excludes(bodies[name])) for name in names}
    references = {name: _reference_positions(tokens[name], bodies) for name in names}
    group = {name: 0 for name in names}
    group_count = 1
    while True:
        signatures: dict[tuple[bool, str], int] = {}
        refined = {}
        for name in names:
            body = list(tokens[name])
            for position in references[name]:
                body[position] = f"@{group[body[position]]}"
            refined[name] = signatures.setdefault((name == root, "".join(body)), len(signatures))
        if len(signatures) == group_count:
            break
        group, group_count = refined, len(signatures)
    kept: dict[int, str] = {}
    for name in names:
        kept.setdefault(group[name], name)
    lines = []
    for name in names:
        if kept[group[name]] != name:
            continue
        body = list(tokens[name])
        for position in references[name]:
            body[position] = kept[group[body[position]]]
        lines.append(f"{name} ::= {''.join(body)}")
    return "\n".join(lines) + "\n"


def _rules(ebnf: str) -> tuple[list[str], dict[str, str]]:
    """Rule names in order and their bodies (a multi-line body continues on lines that start no rule)."""
    names: list[str] = []
    lines: dict[str, list[str]] = {}
    for line in ebnf.split("\n"):
        start = _RULE_START.match(line)
        if start:
            names.append(start.group(1))
            lines[start.group(1)] = [line[start.end():]]
        elif line:
            if not names:
                raise ValueError(f"text before the first rule: {line!r}")
            lines[names[-1]].append(line)
    return names, {name: "\n".join(body) for name, body in lines.items()}


def _reference_positions(tokens: list[str], rules: dict[str, str]) -> list[int]:
    """Where the body names a rule (not a keyword argument such as `excludes=` or its value)."""
    positions = []
    for i, token in enumerate(tokens):
        if token not in rules:
            continue
        if i + 1 < len(tokens) and tokens[i + 1] == "=":
            continue
        if i >= 2 and tokens[i - 1] == "=" and _NAME.fullmatch(tokens[i - 2]):
            continue
        positions.append(i)
    return positions


def _without_redundant_excludes(body: str) -> str:
    def drop(match: re.Match) -> str:
        literals = _LITERAL.findall(match.group(1))
        texts = [_decoded(literal) for literal in literals]
        kept = [
            literal for i, (literal, text) in enumerate(zip(literals, texts))
            if text is None or not any(
                other is not None and other != text and other in text for j, other in enumerate(texts) if j != i
            )
        ]
        return f"excludes=({', '.join(kept)})"

    return _EXCLUDES.sub(drop, body)


def _decoded(literal: str) -> str | None:
    """The text of a string literal, or None where it uses an escape this module does not read."""
    inner = literal[1:-1]
    if "\\" in _JSON_ESCAPES.sub("", inner):
        return None
    return json.loads(literal)
