"""OutputConstraint: a grammar the answer must follow.

The API process turns a request's structured-output ask (a JSON schema, forced or strict tool
calls) into a grammar over text and checks that it is well formed; the engine compiles it against
its own copy of the tokenizer (cached by key) and from then on sees only which token ids each
step allows.
"""

from __future__ import annotations

import msgspec


class OutputConstraint(msgspec.Struct, frozen=True):
    key: str  # digest of the grammar: equal keys, equal grammars (the engine's cache key)
    grammar: str  # xgrammar EBNF (root rule `root`)
    # Thinking requests: the constraint starts after this token (</think>), so reasoning stays
    # free; None constrains from the first output token.
    starts_after_token_id: int | None = None

