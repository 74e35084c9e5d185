"""unrolled_repetitions: a grammar's EBNF with short open-ended repetitions of one character class
spelled out.

The grammar library turns `C{n,}` of a one-character-class rule C (a length-bounded string: a
JSON `minLength`, a tool-call line) into a counted repetition, whose token masks it builds anew
for every grammar: about 30 ms per such class on a 248K vocabulary. `C C ... C C*` (n copies,
then a star) derives the same strings, and its masks are ones the library's rule cache keeps
across grammars (engine/compiled_grammars.py computes them once per engine). Each spelled-out
copy is one more vocabulary-wide mask to compute the first time, so only minimums up to
MAX_UNROLLED_COPIES are spelled out; a maximum keeps the counted form (it needs the counter).
"""

from __future__ import annotations

import re

# The longest minimum spelled out: minLength 1 and 2 are the common ones in tool schemas.
MAX_UNROLLED_COPIES = 2
# A rule whose body is one character class and nothing else (no lookahead), as the library prints it.
_CLASS_RULE = re.compile(r'^([A-Za-z_][A-Za-z0-9_]*) ::= \(\((\[(?:[^\]\\]|\\.)*\])\)\)$', re.M)
# `name{n, -1}`: at least n repetitions, no maximum (outside string literals and classes).
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|([A-Za-z_][A-Za-z0-9_]*)\{(\d+), -1\}', re.S)


def unrolled_repetitions(ebnf: str) -> str:
    """`ebnf` (as the library prints a grammar) with each `C{n, -1}`, C a one-class rule and
    n <= MAX_UNROLLED_COPIES, replaced by `(C' ... C' C'*)` (C' the class itself)."""
    classes = dict(_CLASS_RULE.findall(ebnf))

    def spelled(match: re.Match) -> str:
        name, low = match.group(1), match.group(2)
        if name is None or name not in classes or int(low) > MAX_UNROLLED_COPIES:
            return match.group(0)
        character = classes[name]
        return "(" + " ".join([character] * int(low) + [f"{character}*"]) + ")"

    return _TOKEN.sub(spelled, ebnf)
