"""ConstraintState: one request's place in its output grammar.

Before each step that samples the request, it gives the bitmask of the tokens the grammar allows
next; every committed token advances it (forced tokens too). A thinking request's grammar starts
after the thinking close token: until then nothing is masked, so reasoning stays free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ninfer.frontend.grammar_library import grammar_library

if TYPE_CHECKING:
    import xgrammar

class ConstraintState:
    def __init__(
        self,
        compiled: xgrammar.CompiledGrammar,
        stop_token_ids: Sequence[int],
        vocab_size: int,
        starts_after_token_id: int | None = None,
    ):
        """stop_token_ids: the request's end-of-turn ids, allowed once the grammar is complete."""
        self._matcher = grammar_library().GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)
        self._starts_after = starts_after_token_id
        self.active = starts_after_token_id is None
        self._width = -(-vocab_size // 32)

    def next_token_bitmask(self) -> np.ndarray | None:
        """[ceil(V / 32)] int32, bit v set where token v may come next; None while inactive."""
        if not self.active:
            return None
        mask = np.empty(self._width, dtype=np.int32)
        self._matcher.fill_next_token_bitmask(mask)
        return mask

    def accept(self, token_id: int) -> bool:
        """Advance over a committed token; False when the grammar does not allow it."""
        if not self.active:
            self.active = token_id == self._starts_after
            return True
        return self._matcher.accept_token(token_id)
