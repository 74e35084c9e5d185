"""StopChecker: decides, one committed token at a time, whether a request stops, and which
decoded text is safe to emit.

Stop strings are matched on the decoded text stream (the same text that is emitted, special
tokens included or skipped alike), so a match may span tokens or start inside one. The
checker emits text only when it is UTF-8 complete (the IncrementalDetokenizer's job) and
cannot be the beginning of a stop string: a tail that is a proper prefix of some stop
string is held back until the next token decides it.

When several stop strings could match, the one whose occurrence ends first in the text wins
(ties: the one starting first), which is what a character-by-character reader would see; so
the outcome depends on the text only, never on how it was split into tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ninfer.frontend.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class StopStep:
    text: str  # new text safe to emit now
    stopped: bool = False
    stop_reason: int | str | None = None  # the stop token id or the matched stop string


class StopChecker:
    # Left context for decoding withheld tokens, as the detokenizer keeps it (decoders may
    # treat the first token of a decode differently).
    _CONTEXT_TOKENS = 6

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop_token_ids: Iterable[int] = (),
        stop_strings: Iterable[str] = (),
        skip_special_tokens: bool = False,
    ):
        self.stop_token_ids = frozenset(stop_token_ids)
        self.stop_strings = tuple(stop_strings)
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._detokenizer = tokenizer.incremental(skip_special_tokens)
        self._released_tokens = 0  # tokens whose text the detokenizer has released
        self._held = ""  # decoded text withheld as a possible stop-string beginning
        self.stopped = False
        self.stop_reason: int | str | None = None

    def append(self, token_id: int) -> StopStep:
        """Feed one committed output token."""
        if self.stopped:
            raise RuntimeError("append after the request already stopped")
        if token_id in self.stop_token_ids:
            # The stop token's own text is withheld; whatever came before it is final now.
            step = self._scan(self._held + self._detokenizer.flush(), final=True)
            if step.stopped:  # only possible when the flushed tail completes a stop string
                return step
            return self._stop(step.text, token_id)
        delta = self._detokenizer.push([token_id])
        if delta:
            self._released_tokens = len(self._detokenizer.token_ids)
            return self._scan(self._held + delta, final=False)
        # The detokenizer withholds a token ending mid-character whole, but its complete
        # part may already finish a stop string: stop at this token, not a later one.
        pending = self._held + self._unreleased_complete_text()
        match = self._first_match(pending)
        if match is not None:
            start, stop_string = match
            return self._stop(pending[:start], stop_string)
        return StopStep("")

    def flush(self) -> str:
        """The held-back text at an end that is not a stop (output limit, context end)."""
        if self.stopped:
            return ""
        return self._scan(self._held + self._detokenizer.flush(), final=True).text

    def _unreleased_complete_text(self) -> str:
        """Text of the tokens the detokenizer still withholds, up to its trailing incomplete character."""
        ids = self._detokenizer.token_ids
        context_start = max(0, self._released_tokens - self._CONTEXT_TOKENS)
        skip = self._detokenizer.skip_special_tokens
        released = self._tokenizer.decode(ids[context_start : self._released_tokens], skip)
        full = self._tokenizer.decode(ids[context_start:], skip)
        if not full.startswith(released):
            return ""
        return full[len(released) :].rstrip("\ufffd")

    def _stop(self, text: str, reason: int | str) -> StopStep:
        self.stopped = True
        self.stop_reason = reason
        self._held = ""
        return StopStep(text, stopped=True, stop_reason=reason)

    def _scan(self, pending: str, final: bool) -> StopStep:
        """Emit `pending` up to a stop-string match, or up to a possible match's beginning.

        `pending` = held text + new text; nothing before it can start a match, because any
        earlier start would have been a proper stop-string prefix and so been held."""
        match = self._first_match(pending)
        if match is not None:
            start, stop_string = match
            return self._stop(pending[:start], stop_string)
        keep = 0 if final else self._held_tail_length(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return StopStep(pending[: len(pending) - keep])

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_string in self.stop_strings:
            start = text.find(stop_string)
            if start >= 0:
                candidate = (start + len(stop_string), start, stop_string)
                best = candidate if best is None or candidate[:2] < best[:2] else best
        return None if best is None else (best[1], best[2])

    def _held_tail_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self.stop_strings), default=0)
        for length in range(min(len(text), longest - 1), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return length
        return 0
