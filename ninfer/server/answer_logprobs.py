"""AnswerLogprobs: the log probabilities of a request's answer tokens, in OpenAI's entry shape.

The engine reports one entry per sampled token (TokenLogprobs). Answer tokens are the sampled
tokens after reasoning: not the thinking phase (the </think> token included), not tokens the
engine forced (a thinking budget's close), not the end-of-turn token that stopped the output.
Entries wait here until the wire sends content: each content delta takes the entries of every
token seen so far, so text held back (a possible tool-call opener) is reported with the text
that releases it, and tokens that become a tool call are never reported.

Entry: {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}; `bytes`
are the token's exact UTF-8 bytes (a token may hold part of a character; `token` then shows
U+FFFD for the missing part).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ninfer.contract.output import TokenLogprobs
from ninfer.frontend.grammar_vocabulary import GrammarVocabulary


class AnswerLogprobs:
    def __init__(self, vocabulary: GrammarVocabulary, thinking: bool, think_end_token_id: int | None):
        self.vocabulary = vocabulary
        self._reasoning = thinking and think_end_token_id is not None
        self._think_end = think_end_token_id
        self._pending: list[tuple[int, TokenLogprobs]] = []

    def add(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None], stop_token_id: int | None = None
    ) -> None:
        """One engine delta's tokens and entries; stop_token_id: the end-of-turn token that ended
        the output (on the final delta)."""
        for index, (token_id, entry) in enumerate(zip(token_ids, logprobs)):
            if self._reasoning:
                self._reasoning = token_id != self._think_end
                continue
            if entry is None or (token_id == stop_token_id and index == len(token_ids) - 1):
                continue
            self._pending.append((token_id, entry))

    def take(self) -> list[dict[str, Any]]:
        """The entries not yet sent, shaped for the wire."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        ids = {token_id for token_id, _ in pending}
        for _, entry in pending:
            ids.update(entry.top_token_ids)
        ordered = sorted(ids)
        spelled = dict(zip(ordered, self.vocabulary.token_bytes(ordered)))
        return [
            {
                **_token(spelled[token_id], entry.logprob),
                "top_logprobs": [
                    _token(spelled[i], value) for i, value in zip(entry.top_token_ids, entry.top_logprobs)
                ],
            }
            for token_id, entry in pending
        ]


def _token(data: bytes, logprob: float) -> dict[str, Any]:
    return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}
