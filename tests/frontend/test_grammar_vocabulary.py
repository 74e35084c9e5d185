"""GrammarVocabulary's token bytes table is built once, however many requests ask for it at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ninfer.frontend.grammar_vocabulary import GrammarVocabulary
from tests.unit.conftest import make_byte_tokenizer


class CountingVocabulary(GrammarVocabulary):
    """Counts reads of the library's vocabulary, each slow enough for callers to overlap."""

    reads = 0

    @property
    def info(self):
        self.reads += 1
        time.sleep(0.05)
        return super().info


def test_concurrent_first_callers_build_the_table_once() -> None:
    vocabulary = CountingVocabulary(make_byte_tokenizer(), 257)
    callers = 8
    barrier = threading.Barrier(callers)

    def spell(token_id: int) -> list[bytes]:
        barrier.wait()
        return vocabulary.token_bytes([token_id, 256, 300])

    with ThreadPoolExecutor(callers) as pool:
        spelled = list(pool.map(spell, range(65, 65 + callers)))
    assert vocabulary.reads == 1
    # Byte ids spell their byte, <eos> its text, an id past the vocabulary nothing.
    assert spelled == [[bytes([i]), b"<eos>", b""] for i in range(65, 65 + callers)]
