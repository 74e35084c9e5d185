"""PromptEncoder: token ids of rendered prompts, re-encoding only what a recent prompt did not hold.

An agent resends its whole conversation every turn, so each prompt repeats the previous one's
text up to the end of the last turn, and encoding 60K tokens of repeated text costs a large
part of a turn's time to first token. A prompt is cut only where a clean-splitting special
token starts (a message boundary): the tokenizer splits those out before encoding the rest,
so the text before the cut encodes to exactly the cached ids and the text from the cut on is
encoded on its own.
"""

from __future__ import annotations

import bisect
import collections
import threading
from dataclasses import dataclass

from ninfer.common_prefix import common_prefix_len
from ninfer.frontend.tokenizer import Tokenizer

# Recent prompts kept: a few agent sessions at once.
MAX_ENTRIES = 8


@dataclass(frozen=True)
class EncodedPrompt:
    text: str
    token_ids: list[int]
    split_points: dict[int, int]  # char offset -> token index where text[:offset] encodes to token_ids[:index]


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, max_entries: int = MAX_ENTRIES):
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._recent: collections.deque[EncodedPrompt] = collections.deque(maxlen=max_entries)
        self._lock = threading.Lock()  # prompts are built on worker threads
        self.num_reused_tokens = 0  # for tests and diagnostics

    def encode(self, text: str) -> EncodedPrompt:
        base, cut = self._best_base(text)
        if base is None:
            ids, points = self.tokenizer.encode_with_split_points(text)
        else:
            index = base.split_points[cut]
            tail_ids, tail_points = self.tokenizer.encode_with_split_points(text[cut:])
            ids = base.token_ids[:index] + tail_ids
            points = {offset: i for offset, i in base.split_points.items() if offset < cut}
            points.update({cut + offset: index + i for offset, i in tail_points.items()})
            self.num_reused_tokens += index
        encoded = EncodedPrompt(text, ids, points)
        with self._lock:
            self._recent.append(encoded)
        return encoded

    def _best_base(self, text: str) -> tuple[EncodedPrompt | None, int]:
        """The recent prompt sharing the longest text with `text` up to one of its split points. The
        whole special token at the cut must be shared too, so `text` splits there as well."""
        with self._lock:
            candidates = list(self._recent)
        best, best_cut = None, 0
        for entry in candidates:
            common = common_prefix_len(entry.text, text)
            if common <= best_cut:
                continue
            offsets = sorted(entry.split_points)
            for position in range(bisect.bisect_right(offsets, common) - 1, -1, -1):
                cut = offsets[position]
                if cut <= best_cut:
                    break
                token = self.tokenizer.id_to_token(entry.token_ids[entry.split_points[cut]]) or ""
                if cut + len(token) <= common:
                    best, best_cut = entry, cut
                    break
        return best, best_cut
